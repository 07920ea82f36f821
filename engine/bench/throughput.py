"""`kvpilot bench throughput`: offline throughput of the engine, of plain transformers
`generate` in static batches, and of real vLLM's `LLM.generate` (run by another
interpreter), on the same random token-id prompts and output lengths."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

VLLM_PEER = Path(__file__).with_name("vllm_peer.py")
# What vLLM's CPU backend needs on this kind of machine (install-vllm-cpu.sh says why);
# the caller's environment wins.
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}


@dataclass
class ThroughputResult:
    backend: str
    num_requests: int
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def as_dict(self) -> dict:
        return asdict(self) | {
            "requests_per_s": self.requests_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
        }


def sample_lengths(n: int, mean: int, range_ratio: float, rng: random.Random) -> list[int]:
    lo = max(1, int(mean * (1 - range_ratio)))
    hi = max(lo, int(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def make_workload(args, vocab_size: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    inputs = sample_lengths(args.num_prompts, args.input_len, args.range_ratio, rng)
    outputs = sample_lengths(args.num_prompts, args.output_len, args.range_ratio, rng)
    # Avoid the lowest ids, where a tokenizer keeps its special tokens.
    return [([rng.randrange(16, vocab_size) for _ in range(i)], o) for i, o in zip(inputs, outputs)]


def run_kvpilot(config, workload) -> ThroughputResult:
    from ..llm import LLM
    from ..core.sampling_params import SamplingParams

    llm = LLM(**vars(config))
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o) for _, o in workload]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in workload], params)
    elapsed = time.perf_counter() - start
    return ThroughputResult("kvpilot", len(workload), elapsed,
                            sum(len(p) for p, _ in workload),
                            sum(len(o.outputs[0].token_ids) for o in outs))


def run_hf(args, config, workload) -> ThroughputResult:
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    from ..loader.source import resolve_model

    path = resolve_model(config.model)
    dtype = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[config.dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    pad = 0
    useful = 0
    start = time.perf_counter()
    batches = [workload[i : i + args.hf_batch_size] for i in range(0, len(workload), args.hf_batch_size)]
    for batch in tqdm(batches, desc="hf generate", unit="batch"):
        width = max(len(p) for p, _ in batch)
        new = max(o for _, o in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=pad)
        # A static batch runs to its longest output; only the requested tokens count.
        useful += sum(o for _, o in batch)
    elapsed = time.perf_counter() - start
    return ThroughputResult("hf", len(workload), elapsed, sum(len(p) for p, _ in workload), useful)


def run_vllm(args, config, workload, enforce_eager: bool) -> ThroughputResult:
    """The workload through vLLM's offline API, in a subprocess of `--vllm-python`."""
    from ..loader.source import resolve_model

    with tempfile.TemporaryDirectory(prefix="kvpilot-vllm-") as tmp:
        result_file = Path(tmp) / "result.json"
        spec = {"model": str(resolve_model(config.model)), "dtype": config.dtype,
                "enforce_eager": enforce_eager, "max_num_seqs": config.max_num_seqs,
                # the same chunked-prefill budget (vLLM's offline default on the CPU is 4096)
                "max_num_batched_tokens": config.max_num_batched_tokens,
                "max_model_len": config.max_model_len, "seed": config.seed,
                "enable_prefix_caching": config.enable_prefix_caching,
                "prompts": [p for p, _ in workload], "output_lens": [o for _, o in workload],
                "result_file": str(result_file)}
        mode = "eager" if enforce_eager else "compiled"
        print(f"vllm ({mode}): {args.vllm_python} {VLLM_PEER.name}", file=sys.stderr, flush=True)
        # cwd /: a source checkout's operator/ folder would shadow the standard library's.
        # Its stdout goes to our stderr (fd 2), so --json's stdout stays one document.
        proc = subprocess.run([args.vllm_python, str(VLLM_PEER)], input=json.dumps(spec), text=True,
                              stdout=2, cwd="/", env={**VLLM_CPU_ENV, **os.environ})
        if proc.returncode != 0 or not result_file.exists():
            raise ValueError(f"the vLLM run ({mode}) failed with exit status {proc.returncode}; "
                             "its output is above")
        r = json.loads(result_file.read_text())
    return ThroughputResult(f"vllm-{mode}", r["num_requests"], r["elapsed_s"], r["prompt_tokens"],
                            r["output_tokens"])


def print_result(r: ThroughputResult) -> None:
    print(f"{'=' * 16} Throughput Benchmark Result ({r.backend}) {'=' * 16}")
    print(f"{'Successful requests:':<40}{r.num_requests:<10}")
    print(f"{'Benchmark duration (s):':<40}{r.elapsed_s:<10.2f}")
    print(f"{'Total input tokens:':<40}{r.prompt_tokens:<10}")
    print(f"{'Total generated tokens:':<40}{r.output_tokens:<10}")
    print(f"{'Request throughput (req/s):':<40}{r.requests_per_s:<10.2f}")
    print(f"{'Output token throughput (tok/s):':<40}{r.output_tokens_per_s:<10.2f}")
    print(f"{'Total token throughput (tok/s):':<40}{r.total_tokens_per_s:<10.2f}")
    print("=" * 66)


def _run(args: argparse.Namespace) -> int:
    from ..config.args import engine_config_from_args
    from ..config.model import ModelConfig
    from ..loader.source import resolve_model

    config = engine_config_from_args(args)
    if config.simulate is not None:
        raise ValueError("bench throughput measures the real engine; a simulated accelerator's "
                         "throughput comes from `kvpilot sim run`")
    model_cfg = ModelConfig.from_dir(resolve_model(config.model))
    if args.ceiling:
        from .ceiling import check_ceiling_config

        check_ceiling_config(config, model_cfg)
    if "vllm" in args.backend and not args.vllm_python:
        raise ValueError("--backend vllm needs --vllm-python PATH (a Python with vLLM installed; "
                         "../shared/tools/install-vllm-cpu.sh makes one)")
    workload = make_workload(args, model_cfg.vocab_size, config.seed)
    runs = []
    for backend in args.backend:
        if backend == "kvpilot":
            runs.append(lambda: run_kvpilot(config, workload))
        elif backend == "hf":
            runs.append(lambda: run_hf(args, config, workload))
        else:
            modes = {"eager": [True], "compiled": [False], "both": [True, False]}[args.vllm_mode]
            runs += [lambda eager=eager: run_vllm(args, config, workload, eager) for eager in modes]
    results = []
    for run in runs:
        result = run()
        results.append(result)
        if not args.json:
            print_result(result)
    if len(results) > 1 and not args.json:
        print_comparison(results)
    ceiling = None
    if args.ceiling:  # timed after the runs, which it must not slow down
        from .ceiling import ceiling_for, print_ceiling

        ceiling = ceiling_for(config, model_cfg, workload)
        if not args.json:
            print_ceiling(ceiling, results)
    if args.json:
        print(json.dumps([r.as_dict() | ceiling_fields(r, ceiling) for r in results], indent=2))
    return 0


def ceiling_fields(r: ThroughputResult, ceiling) -> dict:
    """--json's keys for --ceiling (none without): the ceiling, and this run's share of it."""
    if ceiling is None:
        return {}
    return {"ceiling": ceiling.as_dict(),
            "fraction_of_ceiling": r.output_tokens_per_s / ceiling.output_tokens_per_s}


def print_comparison(results: list[ThroughputResult]) -> None:
    """Every backend's output tokens/s, and each as a multiple of kvpilot's."""
    ours = next((r.output_tokens_per_s for r in results if r.backend == "kvpilot"), None)
    print(f"{'backend':<20}{'output tok/s':>14}{'vs kvpilot':>12}")
    for r in results:
        ratio = f"{r.output_tokens_per_s / ours:.2f}x" if ours else "-"
        print(f"{r.backend:<20}{r.output_tokens_per_s:>14.1f}{ratio:>12}")


def add_parser(sub) -> None:
    from ..config.args import add_engine_args

    p = sub.add_parser("throughput", help="offline throughput (kvpilot engine or transformers)")
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from [len*(1-r), len*(1+r)]")
    p.add_argument("--backend", nargs="+", default=["kvpilot"], choices=("kvpilot", "hf", "vllm"))
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="the interpreter of a virtualenv with vLLM, for --backend vllm")
    p.add_argument("--vllm-mode", default="both", choices=("eager", "compiled", "both"),
                   help="vLLM with enforce_eager=True, its default compiled mode, or both")
    p.add_argument("--ceiling", action="store_true",
                   help="after the runs, time this host's float32 matmuls and print the workload's "
                        "arithmetic ceiling (output tok/s no float32 engine passes here) and each "
                        "run's share of it; the real engine on the CPU only (engine/bench/ceiling.py)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run)
