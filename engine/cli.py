"""The `kvpilot` command. Subcommands import their heavy dependencies lazily."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .config import ATTENTION_BACKENDS, DTYPE_CHOICES, EngineConfig
from .flags import add_dataclass_flags, dataclass_from_args
from .sim.config import SimulationConfig

SIMULATE_PREFIX = "simulate_"
COMMANDS_GROUP = "kvpilot.commands"  # entry points: add_parser(subparsers) of more commands


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags, named as vLLM names them, and the simulated accelerator's."""
    p.add_argument("--model", default=None,
                   help="model directory, file:///PATH or builtin:tiny (with --simulate: optional)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    mem = p.add_mutually_exclusive_group()
    mem.add_argument("--kv-cache-memory", default=None,
                     help="KV cache size in bytes (64Mi, 1G and plain integers work); CPU default 1Gi")
    mem.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch's intra-op threads on the CPU (default: torch's, one per core); fewer "
                        "leave cores to the HTTP server and its clients, as vLLM's CPU backend does")
    sim = p.add_argument_group(
        "simulated accelerator", "the real scheduler, KV cache manager, server and metrics, with "
        "the forward pass replaced by a timing model (no GPU, no weights)")
    add_dataclass_flags(sim, SimulationConfig, SIMULATE_PREFIX, {"accelerator": "--simulate"})


def simulation_config_from_args(args: argparse.Namespace) -> SimulationConfig | None:
    if getattr(args, "simulate_accelerator", None) is None:
        given = [f"--{k.replace('_', '-')}" for k, v in vars(args).items()
                 if k.startswith(SIMULATE_PREFIX) and v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need --simulate ACCELERATOR")
        return None
    return dataclass_from_args(SimulationConfig, args, SIMULATE_PREFIX)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, served_model_name=args.served_model_name, dtype=args.dtype,
        device=args.device, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        attention_backend=args.attention_backend, seed=args.seed, cpu_threads=args.cpu_threads,
        simulate=simulation_config_from_args(args),
    )


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from .tiny_model import make_tiny_model

    path = make_tiny_model(
        args.dir, arch=args.arch, layers=args.layers, hidden=args.hidden, heads=args.heads,
        kv_heads=args.kv_heads, intermediate=args.intermediate, vocab=args.vocab,
        seed=args.seed, dtype=args.dtype, max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=args.tie_word_embeddings, rope_theta=args.rope_theta,
        rope_scaling=json.loads(args.rope_scaling) if args.rope_scaling else None,
    )
    print(path)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from .llm import LLM
    from .sampling_params import SamplingParams

    config = engine_config_from_args(args)
    llm = LLM(**vars(config))
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
        top_p=args.top_p, top_k=args.top_k,
    )
    out = llm.generate([args.prompt], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    if args.json:
        print(json.dumps({
            "prompt": args.prompt, "text": completion.text, "token_ids": completion.token_ids,
            "prompt_tokens": len(out.prompt_token_ids), "finish_reason": completion.finish_reason,
        }))
    else:
        print(args.prompt + completion.text)
    return 0


def _version() -> str:
    """The installed distribution's version (what an image tag carries)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvpilot")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpilot", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny-model", help="write a small random-weight HF-format model")
    p.add_argument("dir")
    p.add_argument("--arch", default="llama", choices=("llama", "qwen2", "mistral"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--max-position-embeddings", type=int, default=4096)
    p.add_argument("--tie-word-embeddings", action="store_true")
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--rope-scaling", default=None, help='JSON, e.g. {"rope_type":"llama3",...}')
    p.set_defaults(func=_cmd_make_tiny_model)

    p = sub.add_parser("generate", help="generate one completion offline")
    add_engine_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    # Each module registers its own parser and imports its heavy dependencies only
    # when its command runs. Commands of other kvpilot packages (the operator's) come in
    # as entry points of the group "kvpilot.commands", so the engine never names them.
    from importlib.metadata import entry_points

    from . import bench_serve, bench_throughput
    from .server import cli as server_cli
    from .sim import cli as sim_cli

    bench_throughput.add_parser(bench)
    bench_serve.add_parser(bench)
    server_cli.add_parser(sub)
    sim_cli.add_parser(sub)
    for ep in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        ep.load()(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"kvpilot: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
