"""gpu_check's engine decode part: the engine's decode tokens/s at batch 1, 64 and 256 on a
random model with Llama-3-8B's layer shapes (bf16), in engine variants (MODES): CUDA graphs
on, quantized weights (`--quantization int8`, `int4`: the Triton W8A16/W4A16 GEMM), an fp8
KV cache (`--kv-cache-dtype fp8`: the attention kernels upcasting e4m3), and graphs off
(`enforce_eager`), each beside the bandwidth roofline: a decode step reads every weight
once, so at best batch / (weight bytes / copy bandwidth) tokens/s (KV reads ignored:
256-token contexts). Quantized weights move the roofline (fewer bytes); whether the
engine follows it at batch 1 and where it stops winning at 256 is the field guide's
"quantization made it slower" crossover.

Decode tokens/s is measured as batch * (N - 1) / (t(N tokens) - t(1 token)), so prefill
and the first token drop out. `layers` defaults to 8 of Llama-3-8B's 32 so the part fits
gpu_check's budget (writing and loading 16 GB of random weights twice would not); the
roofline uses the bytes of the model actually run. Failures are recorded, not raised."""

from __future__ import annotations

import gc
import time
from typing import Any

from .part import part_workdir, status_lines

LLAMA3_8B = {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "intermediate": 14336,
             "vocab": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0}
# (name, engine settings), run in this order while time lasts.
MODES = (("graphs", {}), ("int8", {"quantization": "int8"}), ("int4", {"quantization": "int4"}),
         ("fp8-kv", {"kv_cache_dtype": "fp8"}), ("eager", {"enforce_eager": True}))


def run_decode_graphs(
    copy_gb_per_s: float | None,
    deadline: float,
    *,
    layers: int = 8,
    model_shape: dict[str, Any] | None = None,
    dtype: str = "bfloat16",
    device: str = "cuda",
    batches: tuple[int, ...] = (1, 64, 256),
    prompt_len: int = 128,
    decode_tokens: int = 128,
    llm_kwargs: dict[str, Any] | None = None,
    modes: tuple[tuple[str, dict[str, Any]], ...] = MODES,
) -> dict[str, Any]:
    import torch

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    shape = dict(model_shape or LLAMA3_8B)
    shape["layers"] = layers
    result: dict[str, Any] = {"model_shape": shape, "dtype": dtype, "prompt_len": prompt_len,
                              "decode_tokens": decode_tokens, "copy_gb_per_s": copy_gb_per_s}
    with part_workdir(result, "kvpilot-gpu-graphs-") as workdir:
        from kvpilot.engine import LLM, SamplingParams
        from kvpilot.engine.tiny.model import make_tiny_model

        t0 = time.monotonic()
        model_dir = make_tiny_model(workdir / "model", arch="llama", seed=0, dtype=dtype, **shape)
        result["make_model_s"] = time.monotonic() - t0
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(4, min(4000, shape["vocab"]), (max(batches), prompt_len),
                                generator=gen).tolist()
        result["modes"] = [name for name, _ in modes]
        for mode, settings in modes:
            if time.monotonic() > deadline:
                result[mode] = {"skipped": "out of time budget"}
                continue
            kwargs = {"dtype": dtype, "attention_backend": "triton", "max_num_seqs": max(batches),
                      "max_model_len": prompt_len + decode_tokens + 16,
                      **({"gpu_memory_utilization": 0.5} if device == "cuda" else {}),
                      **(llm_kwargs or {}), **settings}
            t = time.monotonic()
            llm = LLM(model=str(model_dir), **kwargs)
            runner = llm.engine.runner
            entry: dict[str, Any] = {"load_s": time.monotonic() - t,
                                     "cuda_graphs": runner.graphs is not None,
                                     "weight_bytes": runner.weight_bytes}
            if runner.graphs is not None:
                entry.update(capture_s=runner.graphs.capture_seconds,
                             capture_mib=runner.graphs.capture_bytes / 2**20,
                             buckets=len(runner.graphs.sizes))
            llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                         use_tqdm=False)
            for b in batches:
                if time.monotonic() > deadline:
                    entry[f"batch_{b}"] = {"skipped": "out of time budget"}
                    continue
                times = []
                for n in (1, decode_tokens):
                    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                    sync()
                    t = time.monotonic()
                    llm.generate(prompts[:b], params, use_tqdm=False)
                    sync()
                    times.append(time.monotonic() - t)
                tok_s = b * (decode_tokens - 1) / max(times[1] - times[0], 1e-9)
                row: dict[str, Any] = {"decode_tok_per_s": tok_s, "step_ms": 1e3 * b / tok_s}
                if copy_gb_per_s:
                    roofline = b / (runner.weight_bytes / (copy_gb_per_s * 1e9))
                    row.update(roofline_tok_per_s=roofline, frac_of_roofline=tok_s / roofline)
                entry[f"batch_{b}"] = row
            result[mode] = entry
            del llm, runner
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
            if mode != "graphs" and "graphs" in result and "batch_1" in result["graphs"]:
                for key, row in entry.items():  # against graphs on, float weights and cache
                    base = result["graphs"].get(key, {})
                    if key.startswith("batch_") and "decode_tok_per_s" in row and "decode_tok_per_s" in base:
                        row["vs_graphs"] = row["decode_tok_per_s"] / base["decode_tok_per_s"]
    return result


def format_graphs(result: dict[str, Any]) -> list[str]:
    """gpu_check's table lines for this part."""
    status = status_lines(result, "engine decode")
    if status is not None:
        return status
    shape = result["model_shape"]
    lines = [f"decode, random Llama-3-8B-shaped model ({shape['layers']} layers, {result['dtype']}): "
             f"graphs, int8/int4 weights, fp8 KV, eager (x: vs graphs):"]
    for mode in result.get("modes", ("graphs", "eager")):
        entry = result.get(mode, {})
        if "skipped" in entry or not entry:
            lines.append(f"  {mode:6s} {entry.get('skipped', 'not run')}")
            continue
        capture = (f" (capture {entry['capture_s']:.1f} s, {entry['capture_mib']:.0f} MiB)"
                   if "capture_s" in entry else "")
        cells = []
        for key, row in entry.items():
            if key.startswith("batch_") and "decode_tok_per_s" in row:
                roof = (f" = {100 * row['frac_of_roofline']:.0f}% of roofline"
                        if "frac_of_roofline" in row else "")
                versus = f", {row['vs_graphs']:.2f}x" if "vs_graphs" in row else ""
                cells.append(f"b={key[6:]} {row['decode_tok_per_s']:.0f} tok/s{roof}{versus}")
        lines.append(f"  {mode:6s} " + "; ".join(cells) + capture)
    return lines
