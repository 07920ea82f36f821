"""One-shot check of kvpilot's Triton kernels on a GPU (and its CPU dry run).

    python -m kvpilot.kernels.gpu_check [--out gpu_check_results.json] [--budget-s 280]
    python -m kvpilot.kernels.gpu_check --cpu      # interpreter, small shapes, no timing

On a CUDA device it runs, in this order, within ``--budget-s`` seconds:
1. correctness of every kernel against its torch reference (and of the reference
   against float64 dense attention) over head dims 32..256, block sizes 8/16/32,
   GQA 1/4/8, fp16/bf16/fp32, ragged lengths, shuffled blocks, NaN-poisoned cache
   tails and outputs;
2. the device-to-device copy bandwidth (``y.copy_(x)`` of 1 GiB; read + write bytes
   / time);
3. decode bandwidth for Llama-3-8B's attention (32 query heads, 8 KV heads, head
   dim 128, bf16, block size 16) at batch 1/16/64/256 x context 512/2k/8k: K/V bytes
   read / median time (``triton.testing.do_bench``), as a fraction of the copy
   bandwidth, beside ``F.scaled_dot_product_attention`` on a contiguous cache;
   plus one long-prompt prefill beside SDPA's causal attention;
4. the engine's decode tokens/s at batch 1, 64 and 256 on a random model with
   Llama-3-8B's layer shapes (``--graphs-layers``, default 8 of 32): CUDA graphs on, int8
   and int4 weights, an fp8 KV cache, graphs off; each beside the roofline weight bytes /
   copy bandwidth and the first (gpu_check_graphs.py);
5. batch-1 decode tokens/s without speculation, with n-gram drafts and with a random
   Llama-3.2-1B-shaped draft model, on that target and a repeated prompt
   (gpu_check_spec.py);
6. the integer-weight GEMM (int4 group 128, int8 per-channel) on Llama-3-8B's linear
   shapes at M = 1/16/64/256, checked against its reference, beside cuBLAS fp16 on the
   dequantized weight (gpu_check_quant.py);
7. if time is left, the engine end to end on a random-weight model of
   Llama-3.2-1B's shape (bf16): offline throughput at 1 and 64 concurrent
   requests, beside ``transformers`` ``generate`` on the same weights and prompts,
   then the engine's step times over the simulator's calibration and validation
   grids, written to ``<out>.steps.json`` for ``kvpilot sim calibrate --steps FILE
   --base h100-80gb`` (the file carries the model's config). Failures here are
   recorded, not fatal.

Full results go to ``--out`` as JSON; a short table is printed last. Without CUDA
(or with ``--cpu``) only step 1 runs, under ``TRITON_INTERPRET=1`` with small shapes.
Exit status: 0 when every correctness case is within tolerance, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from .check.attention import measure_copy_bandwidth, measure_decode, measure_decode_sweep, measure_prefill
from .check.correctness import run_correctness
from .check.e2e import run_end_to_end
from .check.graphs import format_graphs, run_decode_graphs
from .check.quant import format_quant_gemm, run_quant_gemm
from .check.parallel import format_parallel, run_parallel
from .check.spec import format_speculative, run_speculative

E2E_MIN_SECONDS = 100  # don't start the end-to-end part with less budget than this
SPEC_MIN_SECONDS = 60  # nor the speculative-decoding part (after the graphs) with less than this beyond that
GRAPHS_MIN_SECONDS = 90  # nor the CUDA-graph part (before it) with less than this beyond that
QUANT_MIN_SECONDS = 30  # nor the quant GEMM part (after the speculative one) with less than this beyond that


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kvpilot.kernels.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_check_results.json", help="where to write the full JSON results")
    parser.add_argument("--cpu", action="store_true", help="interpreter dry run: correctness on small shapes only")
    parser.add_argument("--budget-s", type=float, default=280.0, help="wall-clock budget for the whole run")
    parser.add_argument("--skip-e2e", action="store_true", help="skip the engine end-to-end part")
    parser.add_argument("--graphs-layers", type=int, default=8,
                        help="layers of the Llama-3-8B-shaped model in the CUDA-graph part (32: all)")
    parser.add_argument("--e2e-max-tokens", type=int, default=128)
    parser.add_argument("--e2e-prompt-len", type=int, default=128)
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- bandwidth


def format_table(results: dict[str, Any]) -> str:
    lines = [f"kvpilot kernel check on {results['device']} ({results['mode']}), {results['elapsed_s']:.0f} s"]
    rows = [r for r in results["correctness"] if "skipped" not in r]
    skipped = len(results["correctness"]) - len(rows)
    bad = [r for r in rows if not r.get("ok")]
    lines.append(f"correctness: {len(rows) - len(bad)}/{len(rows)} cases within tolerance"
                 + (f" ({skipped} skipped: out of time)" if skipped else ""))
    for kernel in ("write", "decode", "prefill"):
        mine = [r for r in rows if r.get("kernel") == kernel and "kernel_vs_ref" in r]
        for dtype, cache in sorted({(r["dtype"], r.get("cache_dtype", "")) for r in mine}):
            same = [r for r in mine if (r["dtype"], r.get("cache_dtype", "")) == (dtype, cache)]
            errs = [r["kernel_vs_ref"] for r in same]
            label = f"{dtype}/{cache}" if cache else dtype
            lines.append(f"  {kernel:8s} {label:13s} worst rel err {max(errs):.1e} (tol {same[0]['kernel_tol']:.0e})")
    for r in bad[:5]:
        lines.append(f"  FAILED {r.get('kernel')} {r.get('dtype')} {r.get('cache_dtype', '')} hd={r.get('head_dim')} "
                     f"bs={r.get('block_size')} g={r.get('group')}: {r.get('error') or r.get('kernel_vs_ref')}")
    copy = results.get("copy_bandwidth")
    if copy:
        lines.append(f"D2D copy bandwidth: {copy['gb_per_s']:.0f} GB/s (read + write)")
    decode = results.get("decode")
    if decode:
        lines.append("decode, Llama-3-8B attention (32 q / 8 kv heads, d 128, bf16, block 16):")
        lines.append("  batch    ctx splits      us   GB/s  %copy  sdpa_us  sdpa/ours")
        for r in decode:
            if "ms" not in r:
                lines.append(f"  {r['batch']:5d} {r['context']:6d}  {r.get('error') or r.get('skipped')}")
                continue
            sdpa = (f"{r['sdpa_ms'] * 1e3:8.1f} {r['speedup_vs_sdpa']:9.2f}x" if "sdpa_ms" in r
                    else f"  SDPA failed: {r.get('sdpa_error', 'n/a')[:60]}")
            lines.append(f"  {r['batch']:5d} {r['context']:6d} {r['num_splits']:6d} {r['ms'] * 1e3:7.1f} "
                         f"{r['gb_per_s']:6.0f} {100 * r['frac_of_copy']:5.0f}% {sdpa}")
    sweep = [r for r in results.get("decode_config_sweep", []) if "ms" in r]
    for batch, ctx in sorted({(r["batch"], r["context"]) for r in sweep}):
        rows_here = [r for r in sweep if (r["batch"], r["context"]) == (batch, ctx)]
        best = min(rows_here, key=lambda r: r["ms"])
        default = next((r for r in rows_here if r["is_default"]), None)
        lines.append(f"decode tile sweep b={batch} ctx={ctx}: best BLOCK_N={best['BLOCK_N']} warps={best['num_warps']} "
                     f"{best['gb_per_s']:.0f} GB/s" + (f" (default {default['gb_per_s']:.0f} GB/s)" if default else ""))
    prefill = results.get("prefill")
    if prefill:
        if "ms" in prefill:
            lines.append(f"prefill 4096 tokens: {prefill['ms']:.2f} ms, {prefill['tflops']:.0f} TFLOP/s; "
                         f"SDPA {prefill['sdpa_ms']:.2f} ms ({prefill['speedup_vs_sdpa']:.2f}x)")
        else:
            lines.append(f"prefill: {prefill.get('error')}")
    if results.get("graphs"):
        lines += format_graphs(results["graphs"])
    if results.get("speculative"):
        lines += format_speculative(results["speculative"])
    if "parallel" in results:
        lines += format_parallel(results["parallel"])
    if results.get("quant_gemm"):
        lines += format_quant_gemm(results["quant_gemm"])
    e2e = results.get("e2e")
    if e2e:
        if "error" in e2e:
            lines.append(f"end to end: FAILED {e2e['error']}")
        elif "skipped" in e2e:
            lines.append(f"end to end: skipped ({e2e['skipped']})")
        for n in (1, 64):
            ours, hf = e2e.get(f"kvpilot_{n}", {}), e2e.get(f"transformers_{n}", {})
            if "tok_per_s" in ours or "tok_per_s" in hf:
                match = f", first-token match {hf['first_token_match']:.0%}" if "first_token_match" in hf else ""
                lines.append(f"end to end, {n:2d} requests: kvpilot {ours.get('tok_per_s', float('nan')):.0f} tok/s, "
                             f"transformers {hf.get('tok_per_s', float('nan')):.0f} tok/s{match}")
    lines.append(f"full results: {results['out']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    started = time.monotonic()
    deadline = started + args.budget_s

    import torch

    cpu = args.cpu or not torch.cuda.is_available()
    if cpu:
        # Must be set before the kernel modules are imported (triton decides at @jit time).
        was_interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        os.environ["TRITON_INTERPRET"] = "1"
        loaded = [m for m in ("kvpilot.kernels.paged_decode_attention", "kvpilot.kernels.paged_prefill_attention",
                              "kvpilot.kernels.kv_cache_write") if m in sys.modules]
        if loaded and not was_interpreting:
            raise RuntimeError(f"kernel modules {loaded} were imported before TRITON_INTERPRET could be set")
    elif "kvpilot.kernels.paged_decode_attention" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "0"  # an inherited TRITON_INTERPRET=1 would time the interpreter
    device = "cpu" if cpu else "cuda"
    results: dict[str, Any] = {
        "mode": "cpu-interpreter" if cpu else "gpu",
        "device": (platform.processor() or "cpu") if cpu else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "out": str(Path(args.out).absolute()),
    }
    try:
        import triton

        results["triton"] = triton.__version__
    except Exception as exc:
        results["triton"] = f"unavailable: {exc}"
    if not cpu:
        props = torch.cuda.get_device_properties(0)
        results["sm_count"] = props.multi_processor_count
        results["gpu_memory_gib"] = props.total_memory / 2**30

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every part, so a hard crash later still leaves results
        results["elapsed_s"] = time.monotonic() - started
        results["all_correct"] = (all(r.get("ok") for r in results["correctness"] if "skipped" not in r)
                                  and results.get("quant_gemm", {}).get("all_correct", True))
        out_path.write_text(json.dumps(results, indent=2, default=str))

    # Correctness first (each new kernel variant compiles once, ~1 s): at most ~45% of the budget.
    results["correctness"] = run_correctness(cpu, device, started + 0.45 * args.budget_s)
    save()
    if not cpu:
        try:
            results["copy_bandwidth"] = measure_copy_bandwidth()
            results["decode"] = measure_decode(results["copy_bandwidth"]["gb_per_s"], deadline - E2E_MIN_SECONDS)
            save()
            results["prefill"] = measure_prefill()
            results["decode_config_sweep"] = measure_decode_sweep(deadline - E2E_MIN_SECONDS)
        except Exception as exc:
            results["timing_error"] = f"{type(exc).__name__}: {exc}"
        save()
        if args.skip_e2e:
            results["graphs"] = {"skipped": "--skip-e2e"}
        elif deadline - time.monotonic() < E2E_MIN_SECONDS + GRAPHS_MIN_SECONDS:
            results["graphs"] = {"skipped": "out of time budget"}
        else:
            results["graphs"] = run_decode_graphs(results.get("copy_bandwidth", {}).get("gb_per_s"),
                                                  deadline - E2E_MIN_SECONDS, layers=args.graphs_layers)
        save()
        for part, run_part in (("speculative", run_speculative), ("parallel", run_parallel)):
            if args.skip_e2e:
                results[part] = {"skipped": "--skip-e2e"}
            elif deadline - time.monotonic() < E2E_MIN_SECONDS + SPEC_MIN_SECONDS:
                results[part] = {"skipped": "out of time budget"}
            else:
                results[part] = run_part(deadline - E2E_MIN_SECONDS, layers=args.graphs_layers)
            save()
        e2e_reserve = 0 if args.skip_e2e else E2E_MIN_SECONDS  # a kernel benchmark: runs with --skip-e2e too
        if deadline - time.monotonic() < e2e_reserve + QUANT_MIN_SECONDS:
            results["quant_gemm"] = {"skipped": "out of time budget"}
        else:
            results["quant_gemm"] = run_quant_gemm(deadline - e2e_reserve,
                                                   copy_gb_per_s=results.get("copy_bandwidth", {}).get("gb_per_s"))
        save()
        if args.skip_e2e:
            results["e2e"] = {"skipped": "--skip-e2e"}
        elif deadline - time.monotonic() < E2E_MIN_SECONDS:
            results["e2e"] = {"skipped": f"less than {E2E_MIN_SECONDS} s of the budget left"}
        else:
            steps = out_path.with_suffix(".steps.json")
            results["e2e"] = run_end_to_end(args.e2e_prompt_len, args.e2e_max_tokens, deadline, steps_out=steps)
    else:
        results["timing"] = "skipped: no GPU (correctness ran under TRITON_INTERPRET=1 on small shapes)"

    save()
    print(format_table(results))
    return 0 if results["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
