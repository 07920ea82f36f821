"""`kvpilot bench quantization`: what quantize-at-load (`--quantization int8|int4`) and an fp8
KV cache (`--kv-cache-dtype fp8`, method `fp8-kv`: float weights) cost and give on one
model, against its float weights and float cache:

- memory: the engine's resident weight bytes (float32 as run here, and bfloat16), and the
  KV-cache tokens that fit in the same `--kv-cache-memory`;
- quality: held-out perplexity (the Python standard library files the trained tiny models
  never saw, scored with the same round-to-nearest weights in tiny_train's model, or with
  K/V rounded through e4m3 as the cache stores them) and greedy agreement with the float
  engine over the first tokens of held-out prompts;
- speed: output tokens/s of the engine on this CPU at batch 1 and a large batch.

Same prompts for every method; greedy, fixed output length (ignore_eos)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field

METHODS = ("none", "int8", "int4", "fp8-kv")
WEIGHT_METHODS = ("int8", "int4")  # --quantization; fp8-kv keeps float weights


@dataclass
class QuantRun:
    method: str  # none | int8 | int4 | fp8-kv
    weight_bytes_float32: int
    weight_bytes_bfloat16: int
    perplexity: float | None
    kv_tokens: int = 0  # tokens the float32 run's KV cache holds in --kv-cache-memory
    agreement_tokens: list[int] = field(default_factory=list)  # per prompt: tokens equal to float's before the first difference
    output_tokens_per_s: dict[int, float] = field(default_factory=dict)  # batch -> tok/s

    def mean_agreement(self, out_len: int) -> float:
        return sum(self.agreement_tokens) / (len(self.agreement_tokens) * out_len) if self.agreement_tokens else 0.0


def _scheme_weights(method: str, checkpoint: dict) -> dict:
    """The checkpoint with every decoder linear's weight replaced by its dequantized
    round-to-nearest twin under `method`'s scheme (what the engine computes with)."""
    from kvpilot.kernels.quant_pack import dequantize, quantize_rtn
    from ..quant.quantize import SCHEMES

    scheme = SCHEMES[method]
    out = {}
    for name, t in checkpoint.items():
        if ".layers." in name and name.endswith("_proj.weight"):
            q = quantize_rtn(t, scheme.bits, scheme.group_for(t.shape[1]), scheme.symmetric)
            t = dequantize(q, t.dtype)
        out[name] = t
    return out


def heldout_perplexity(model_dir, method: str, seq_len: int, eval_tokens: int) -> float | None:
    """tiny_train's held-out perplexity of the checkpoint at `model_dir` under `method`;
    None when the model is not one tiny_train's model can hold."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    from ..config.model import ModelConfig
    from ..models.llama_train import TrainableLlama
    from ..tiny.train import corpus_split, encode_files, heldout_perplexity as perplexity, heldout_windows

    config = ModelConfig.from_dir(model_dir)
    if config.architecture != "llama" or config.max_position_embeddings < seq_len:
        return None
    saved = {k: t.float() for k, t in load_file(str(model_dir / "model.safetensors")).items()}
    if method in WEIGHT_METHODS:
        saved = _scheme_weights(method, saved)
    model = TrainableLlama(config, seq_len)
    model.load_checkpoint(saved)
    if method == "fp8-kv":
        for layer in model.model.layers:
            layer.self_attn.kv_round = _fp8_round
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    _, held = corpus_split()
    windows = heldout_windows(encode_files(tokenizer, held), seq_len, eval_tokens)
    return perplexity(model, windows)


def _fp8_round(t):
    """K or V as an fp8 cache (scale 1.0, as the engine without calibrated scales) reads it back."""
    from kvpilot.kernels.kv_cache_dtype import dequantize_fp8, quantize_fp8

    return dequantize_fp8(quantize_fp8(t, 1.0), 1.0, t.dtype)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading tokens two outputs share (gpu_check's end-to-end part uses it too)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_all(args: argparse.Namespace) -> tuple[list[QuantRun], int]:
    from .speculative import workload_prompts
    from ..llm import LLM
    from ..loader.source import resolve_model
    from ..core.sampling_params import SamplingParams

    model_dir = resolve_model(args.model)
    runs: list[QuantRun] = []
    float_tokens: list[list[int]] | None = None
    prompts = None
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for i, method in enumerate(args.methods):
        quant = method if method in WEIGHT_METHODS else None
        kv_cache_dtype = "fp8" if method == "fp8-kv" else "auto"
        print(f"[{i + 1}/{len(args.methods)}] {method}: memory", file=sys.stderr, flush=True)
        bf16 = LLM(args.model, dtype="bfloat16", quantization=quant, max_num_seqs=1, kv_cache_memory="16Mi")
        bf16_bytes = bf16.engine.weight_bytes
        del bf16
        llm = LLM(args.model, dtype="float32", quantization=quant, max_num_seqs=max(args.batch_sizes), seed=0,
                  kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=kv_cache_dtype)
        if prompts is None:
            n = max(max(args.batch_sizes) * args.waves, args.agreement_prompts)
            prompts = workload_prompts("free", n, args.prompt_tokens, llm.get_tokenizer())
        print(f"[{i + 1}/{len(args.methods)}] {method}: perplexity", file=sys.stderr, flush=True)
        ppl = heldout_perplexity(model_dir, method, args.ppl_seq_len, args.ppl_tokens)
        run = QuantRun(method, llm.engine.weight_bytes, bf16_bytes, ppl, llm.engine.kv_capacity_tokens)
        outs = llm.generate(prompts[:args.agreement_prompts], params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        if float_tokens is None and method == "none":
            float_tokens = tokens
        if float_tokens is not None:
            run.agreement_tokens = [common_prefix_len(a, b) for a, b in zip(tokens, float_tokens)]
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
        for batch in args.batch_sizes:
            llm.engine.update_limits(max_num_seqs=batch)
            wave = prompts[:batch * args.waves]
            start = time.perf_counter()
            outs = llm.generate(wave, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            run.output_tokens_per_s[batch] = sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
            print(f"[{i + 1}/{len(args.methods)}] {method}: batch {batch} "
                  f"{run.output_tokens_per_s[batch]:.1f} output tok/s", file=sys.stderr, flush=True)
        runs.append(run)
        del llm
    return runs, args.output_len


def print_table(runs: list[QuantRun], out_len: int, batch_sizes: list[int]) -> None:
    base = next((r for r in runs if r.method == "none"), None)
    speed_cols = "".join(f"{f'b{b} tok/s':>12}" for b in batch_sizes)
    print(f"{'method':<8}{'weights fp32':>14}{'weights bf16':>14}{'vs bf16':>9}{'KV tokens':>11}{'perplexity':>12}"
          f"{'agreement':>11}{speed_cols}")
    for r in runs:
        ratio = f"{r.weight_bytes_bfloat16 / base.weight_bytes_bfloat16:.2f}x" if base else "-"
        ppl = f"{r.perplexity:.1f}" if r.perplexity is not None else "-"
        agree = f"{r.mean_agreement(out_len):.0%}" if r.agreement_tokens else "-"
        speeds = "".join(f"{r.output_tokens_per_s.get(b, 0.0):>12.1f}" for b in batch_sizes)
        print(f"{r.method:<8}{r.weight_bytes_float32 / 2**20:>11.1f}MiB{r.weight_bytes_bfloat16 / 2**20:>11.1f}MiB"
              f"{ratio:>9}{r.kv_tokens:>11}{ppl:>12}{agree:>11}{speeds}")
    print(f"(agreement: the share of the first {out_len} greedy tokens equal to the float engine's "
          f"before the first difference, averaged over prompts; KV tokens: what the float32 run's cache "
          f"holds in the same --kv-cache-memory)")


def _run(args: argparse.Namespace) -> int:
    for name in ("output_len", "prompt_tokens", "waves", "agreement_prompts", "ppl_seq_len", "ppl_tokens"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {value}")
    if any(b < 1 for b in args.batch_sizes):
        raise ValueError(f"batch-sizes must be >= 1, got {args.batch_sizes}")
    runs, out_len = run_all(args)
    if args.json:
        print(json.dumps([asdict(r) for r in runs], indent=2))
    else:
        print_table(runs, out_len, args.batch_sizes)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("quantization", help="quantize-at-load (int8, int4) and an fp8 KV cache (fp8-kv) "
                                            "against float weights and cache")
    p.add_argument("--model", default="builtin:tiny-trained")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                   help="'none' (float) first: agreement is measured against it")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32])
    p.add_argument("--waves", type=int, default=2, help="requests per batch slot (batch 1: requests in a row)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--agreement-prompts", type=int, default=16)
    p.add_argument("--ppl-seq-len", type=int, default=256)
    p.add_argument("--ppl-tokens", type=int, default=32768, help="held-out tokens scored")
    p.add_argument("--kv-cache-memory", default="512Mi")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run)
