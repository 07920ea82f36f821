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
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

from .check.correctness import run_correctness
from .check.e2e import run_end_to_end
from .check.graphs import format_graphs, run_decode_graphs
from .check.quant import format_quant_gemm, run_quant_gemm
from .check.parallel import format_parallel, run_parallel
from .check.spec import format_speculative, run_speculative

LLAMA3_8B = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXTS = (512, 2048, 8192)
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


def _bench_ms(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


def measure_copy_bandwidth() -> dict[str, Any]:
    import torch

    nbytes = 1 << 30
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = _bench_ms(lambda: dst.copy_(src))
    return {"bytes": nbytes, "ms": ms, "gb_per_s": 2 * nbytes / (ms * 1e-3) / 1e9,
            "note": "copy of 1 GiB, counting read + write bytes"}


def _decode_inputs(batch: int, ctx: int, seed: int = 0) -> dict[str, Any]:
    """Llama-3-8B-shaped decode inputs over a shuffled paged cache (bf16, block 16)."""
    import torch

    h, hkv, d = LLAMA3_8B["num_heads"], LLAMA3_8B["num_kv_heads"], LLAMA3_8B["head_dim"]
    block_size, dtype = 16, torch.bfloat16
    blocks_per_seq = ctx // block_size
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "query": torch.randn(batch, h, d, device="cuda", dtype=dtype, generator=gen),
        "k_cache": torch.randn(num_blocks, block_size, hkv, d, device="cuda", dtype=dtype, generator=gen),
        "v_cache": torch.randn(num_blocks, block_size, hkv, d, device="cuda", dtype=dtype, generator=gen),
        "block_tables": torch.randperm(num_blocks, device="cuda", generator=gen).view(batch, blocks_per_seq).int(),
        "seq_lens": torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
        "scale": d**-0.5,
    }


def _kv_bytes(inputs: dict[str, Any]) -> int:
    return 2 * inputs["k_cache"].numel() * inputs["k_cache"].element_size()


def _measure_decode_point(batch: int, ctx: int, copy_gb_per_s: float) -> dict[str, Any]:
    import torch.nn.functional as F

    from kvpilot.kernels.paged_decode_attention import _num_sms, choose_num_splits, paged_decode_attention

    x = _decode_inputs(batch, ctx, seed=batch * 7 + ctx)
    q, scale = x["query"], x["scale"]
    args = (q, x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], scale)
    kv_bytes = _kv_bytes(x)
    hkv, d = LLAMA3_8B["num_kv_heads"], LLAMA3_8B["head_dim"]
    splits = choose_num_splits(batch, hkv, ctx, _num_sms(q.device))
    out = paged_decode_attention(*args, max_seq_len=ctx)
    ms = _bench_ms(lambda: paged_decode_attention(*args, max_seq_len=ctx, out=out))
    gb_per_s = kv_bytes / (ms * 1e-3) / 1e9
    row: dict[str, Any] = {"batch": batch, "context": ctx, "num_splits": splits, "kv_bytes": kv_bytes, "ms": ms,
                           "gb_per_s": gb_per_s, "frac_of_copy": gb_per_s / copy_gb_per_s}
    if batch <= 16:  # other split counts, to check the heuristic where it matters
        row["ms_by_num_splits"] = {
            s: _bench_ms(lambda s=s: paged_decode_attention(*args, s, out=out))
            for s in sorted({1, max(1, splits // 2), splits * 2} - {splits})
        }
    # SDPA on a contiguous cache holding the same keys/values: [batch, kv_heads, ctx, head_dim].
    tables = x.pop("block_tables").long()
    k_dense = x.pop("k_cache")[tables].reshape(batch, ctx, hkv, d).transpose(1, 2).contiguous()
    v_dense = x.pop("v_cache")[tables].reshape(batch, ctx, hkv, d).transpose(1, 2).contiguous()
    args = ()
    q4 = q.unsqueeze(2)  # [batch, heads, 1, head_dim]

    def sdpa():
        return F.scaled_dot_product_attention(q4, k_dense, v_dense, scale=scale, enable_gqa=True)

    try:
        ref = sdpa().squeeze(2)
        row["max_abs_diff_vs_sdpa"] = float((ref.float() - out.float()).abs().max())
        sdpa_ms = _bench_ms(sdpa)
        row.update(sdpa_ms=sdpa_ms, sdpa_gb_per_s=kv_bytes / (sdpa_ms * 1e-3) / 1e9, speedup_vs_sdpa=sdpa_ms / ms)
    except Exception as exc:  # e.g. SDPA's GQA path out of memory at batch 256 x 8k
        row["sdpa_error"] = f"{type(exc).__name__}: {exc}"[:500]
    return row


def measure_decode(copy_gb_per_s: float, deadline: float) -> list[dict[str, Any]]:
    import torch

    rows = []
    for batch in DECODE_BATCHES:
        for ctx in DECODE_CONTEXTS:
            if time.monotonic() > deadline:
                rows.append({"batch": batch, "context": ctx, "skipped": "out of time budget"})
                continue
            try:
                rows.append(_measure_decode_point(batch, ctx, copy_gb_per_s))
            except Exception as exc:
                rows.append({"batch": batch, "context": ctx, "error": f"{type(exc).__name__}: {exc}"[:500]})
            finally:
                gc.collect()
                torch.cuda.empty_cache()
    return rows


def measure_decode_sweep(deadline: float) -> list[dict[str, Any]]:
    """Decode time under alternative tile/warp settings, to tune ``_launch_config``."""
    import torch

    from kvpilot.kernels import paged_decode_attention as decode

    default = decode._launch_config
    group = LLAMA3_8B["num_heads"] // LLAMA3_8B["num_kv_heads"]
    base = default(LLAMA3_8B["head_dim"], group, torch.bfloat16)
    rows: list[dict[str, Any]] = []
    try:
        for batch, ctx in ((1, 8192), (64, 2048)):
            x = _decode_inputs(batch, ctx)
            args = (x["query"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], x["scale"])
            for block_n in (32, 64, 128):
                for warps in (4, 8):
                    if time.monotonic() > deadline:
                        return rows
                    config = {**base, "BLOCK_N": block_n, "num_warps": warps}
                    row = {"batch": batch, "context": ctx, "BLOCK_N": block_n, "num_warps": warps,
                           "is_default": config == base}
                    decode._launch_config = lambda *_, c=config: c
                    try:
                        row["ms"] = _bench_ms(lambda a=args, n=ctx: decode.paged_decode_attention(*a, max_seq_len=n))
                        row["gb_per_s"] = _kv_bytes(x) / (row["ms"] * 1e-3) / 1e9
                    except Exception as exc:
                        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
                    finally:
                        decode._launch_config = default
                    rows.append(row)
            x.clear()
            args = ()
    finally:
        decode._launch_config = default
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def measure_prefill() -> dict[str, Any]:
    """One 4096-token prompt with Llama-3-8B's attention shape, against SDPA causal."""
    import torch
    import torch.nn.functional as F

    from kvpilot.kernels.paged_prefill_attention import paged_prefill_attention

    h, hkv, d = LLAMA3_8B["num_heads"], LLAMA3_8B["num_kv_heads"], LLAMA3_8B["head_dim"]
    n, block_size, dtype, scale = 4096, 16, torch.bfloat16, LLAMA3_8B["head_dim"] ** -0.5
    row: dict[str, Any] = {"tokens": n}
    try:
        nb = n // block_size
        k_cache = torch.randn(nb, block_size, hkv, d, device="cuda", dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(nb, device="cuda").view(1, nb).int()
        seq_lens = torch.tensor([n], dtype=torch.int32, device="cuda")
        qsl = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        q = torch.randn(n, h, d, device="cuda", dtype=dtype)
        out = paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens, qsl, n, scale)
        ms = _bench_ms(lambda: paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens, qsl, n, scale, out=out))
        k = k_cache[tables[0].long()].reshape(n, hkv, d).transpose(0, 1).unsqueeze(0)
        v = v_cache[tables[0].long()].reshape(n, hkv, d).transpose(0, 1).unsqueeze(0)
        q4 = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]

        def sdpa():
            return F.scaled_dot_product_attention(q4, k, v, is_causal=True, scale=scale, enable_gqa=True)

        ref = sdpa()[0].transpose(0, 1)
        flops = 4 * h * d * n * n / 2  # causal: half of QK^T and PV
        sdpa_ms = _bench_ms(sdpa)
        row.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12, sdpa_ms=sdpa_ms,
                   sdpa_tflops=flops / (sdpa_ms * 1e-3) / 1e12, speedup_vs_sdpa=sdpa_ms / ms,
                   max_abs_diff_vs_sdpa=float((ref.float() - out.float()).abs().max()))
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        gc.collect()
        torch.cuda.empty_cache()
    return row


# ----------------------------------------------------------------------------- report


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
