"""gpu_check's integer-weight GEMM part: ``quant_matmul`` (kernels/quant_gemm.py) on
Llama-3-8B-shaped linear layers (K=4096 into N=14336 and N=4096), int4 with group 128 and
int8 per-channel, fp16 activations, at M = 1, 16, 64, 256 tokens, beside cuBLAS fp16
(``x @ w.T`` with the dequantized fp16 weight).

Every point checks correctness first (``quant_matmul`` against ``quant_matmul_reference``,
within ``QUANT_GEMM_RTOL``), then times both with ``triton.testing.do_bench`` (median; it
clears the L2 cache before each call, so the weight is read from HBM as in a full model
whose weights do not fit in L2). Reported per point: time, TFLOP/s (2 M N K / time), GB/s
(bytes of weight + scales + zeros + x + output / time), and cuBLAS's time over ours, and
the time at other split-K counts than ``default_split_k``'s (to tune ``choose_split_k``). At
small M the layer is bound by weight bytes, so int4 can beat fp16 cuBLAS by up to ~4x in
principle; at M = 256 it is compute-bound and the dequantization is overhead.

Random integer weights and scales (the numbers do not depend on the values). Runs only
where gpu_check runs its GPU parts; ``device="cpu"`` with small shapes and a plain timer
exercises the plumbing under the Triton interpreter (tests). Failures are recorded, not
raised."""

from __future__ import annotations

import gc
import time
import traceback
from typing import Any, Callable

# (name, K, N): Llama-3-8B's MLP up/gate projection and its attention output projection.
LLAMA3_8B_LINEARS = (("mlp_up 4096->14336", 4096, 14336), ("attn_o 4096->4096", 4096, 4096))
# (name, bits, group_size or None for per-channel)
SCHEMES = (("int4 g128", 4, 128), ("int8 per-channel", 8, None))
BATCHES = (1, 16, 64, 256)


def _do_bench_ms(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


def _random_weight(k: int, n: int, bits: int, group_size: int, dtype, device: str, seed: int):
    """Packed int32 qweight [K // per_word, N], scales and zeros [num_groups, N] (random)."""
    import torch

    from kvpilot.kernels.quant_pack import per_word

    gen = torch.Generator(device=device).manual_seed(seed)
    groups = -(-k // group_size)
    qweight = torch.randint(-(2**31), 2**31, (k // per_word(bits), n), generator=gen, device=device,
                            dtype=torch.int64).to(torch.int32)  # [K // per_word, N]: every bit random
    zeros = torch.randint(0, 1 << bits, (groups, n), generator=gen, device=device).to(dtype)  # [G, N]
    scales = (0.002 + 0.02 * torch.rand(groups, n, generator=gen, device=device)).to(dtype)  # [G, N]
    return qweight, scales, zeros


def run_quant_gemm(
    deadline: float,
    *,
    device: str = "cuda",
    layers: tuple[tuple[str, int, int], ...] = LLAMA3_8B_LINEARS,
    schemes: tuple[tuple[str, int, int | None], ...] = SCHEMES,
    batches: tuple[int, ...] = BATCHES,
    dtype: str = "float16",
    copy_gb_per_s: float | None = None,
    bench_ms: Callable[[Callable[[], Any]], float] | None = None,
) -> dict[str, Any]:
    """Correctness, then time, of every (scheme, layer, M) point; see the module doc."""
    import torch

    result: dict[str, Any] = {"dtype": dtype, "batches": list(batches), "copy_gb_per_s": copy_gb_per_s,
                              "rows": []}
    bench = bench_ms or _do_bench_ms
    try:
        import triton

        from kvpilot.kernels.quant_pack import QuantizedWeight, dequantize
        from kvpilot.kernels import quant_gemm
        from kvpilot.kernels.quant_gemm import QUANT_GEMM_RTOL, quant_matmul, quant_matmul_reference
        from kvpilot.kernels.testing import rel_error

        torch_dtype = getattr(torch, dtype)
        result["rtol"] = QUANT_GEMM_RTOL[torch_dtype]
        seed = 0
        for scheme, bits, group in schemes:
            for layer, k, n in layers:
                group_size = group or k
                seed += 1
                if time.monotonic() > deadline:  # don't build a weight no point will use
                    result["rows"] += [{"scheme": scheme, "layer": layer, "m": m, "skipped": "out of time budget"}
                                       for m in batches]
                    continue
                qweight, scales, zeros = _random_weight(k, n, bits, group_size, torch_dtype, device, seed)
                w = dequantize(QuantizedWeight(qweight=qweight, scales=scales, zeros=zeros, bits=bits,
                                               group_size=group_size, in_features=k))  # [N, K]
                quant_bytes = sum(t.numel() * t.element_size() for t in (qweight, scales, zeros))
                dense_bytes = w.numel() * w.element_size()
                for m in batches:
                    config = quant_gemm._launch_config(m, n, k, bits)
                    k_tiles = triton.cdiv(k, config["BLOCK_K"])
                    split = quant_gemm.default_split_k(m, n, k, bits, torch.device(device))
                    row: dict[str, Any] = {"scheme": scheme, "layer": layer, "bits": bits,
                                           "group_size": group_size, "m": m, "k": k, "n": n, "split_k": split,
                                           "config": config}
                    result["rows"].append(row)
                    if time.monotonic() > deadline:
                        row["skipped"] = "out of time budget"
                        continue
                    try:
                        gen = torch.Generator(device=device).manual_seed(1000 + m)
                        x = torch.randn(m, k, generator=gen, device=device).to(torch_dtype)  # [M, K]
                        out = quant_matmul(x, qweight, scales, zeros, bits, group_size)  # [M, N]
                        ref = quant_matmul_reference(x, qweight, scales, zeros, bits, group_size)  # [M, N]
                        row["rel_err"] = rel_error(out, ref)
                        row["ok"] = row["rel_err"] <= result["rtol"]
                        if not row["ok"]:  # a wrong kernel's speed is not worth reporting
                            continue
                        io_bytes = (x.numel() + out.numel()) * x.element_size()
                        flops = 2 * m * n * k
                        ms = bench(lambda: quant_matmul(x, qweight, scales, zeros, bits, group_size))
                        dense_ms = bench(lambda: x @ w.t())
                        row.update(
                            ms=ms, tflops=flops / (ms * 1e-3) / 1e12,
                            gb_per_s=(quant_bytes + io_bytes) / (ms * 1e-3) / 1e9,
                            cublas_ms=dense_ms, cublas_tflops=flops / (dense_ms * 1e-3) / 1e12,
                            cublas_gb_per_s=(dense_bytes + io_bytes) / (dense_ms * 1e-3) / 1e9,
                            speedup_vs_cublas=dense_ms / ms,
                        )
                        if copy_gb_per_s:
                            row["frac_of_copy"] = row["gb_per_s"] / copy_gb_per_s
                        others = sorted({1, max(1, split // 2), 2 * split, 4 * split} - {split})
                        row["ms_by_split_k"] = {
                            s: bench(lambda s=s: quant_matmul(x, qweight, scales, zeros, bits, group_size, split_k=s))
                            for s in others if s <= k_tiles
                        }
                    except Exception as exc:
                        row["ok"] = False
                        row["error"] = f"{type(exc).__name__}: {exc}"[:1000]
                    finally:
                        x = out = ref = None
                qweight = scales = zeros = w = None  # free before the next layer's weight
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        result["traceback"] = traceback.format_exc()
    finally:
        gc.collect()
    checked = [r for r in result["rows"] if "ok" in r]
    result["all_correct"] = "error" not in result and all(r["ok"] for r in checked)
    return result


def format_quant_gemm(result: dict[str, Any]) -> list[str]:
    """gpu_check's table lines for this part."""
    if "skipped" in result:
        return [f"quant GEMM: skipped ({result['skipped']})"]
    if "error" in result:
        return [f"quant GEMM: FAILED {result['error']}"]
    rows = result.get("rows", [])
    checked = [r for r in rows if "ok" in r]
    bad = [r for r in checked if not r["ok"]]
    lines = [f"quant GEMM ({result['dtype']} activations) vs cuBLAS fp16 on the dequantized weight: "
             f"{len(checked) - len(bad)}/{len(checked)} points within rel err {result.get('rtol', float('nan')):.0e}"]
    lines.append("  scheme           layer                  M split      us  TFLOP/s   GB/s  cublas_us  cublas/ours")
    for r in rows:
        head = f"  {r['scheme']:16s} {r['layer']:20s} {r['m']:4d}"
        if "ms" in r:
            lines.append(f"{head} {r.get('split_k', 1):5d} {r['ms'] * 1e3:7.1f} {r['tflops']:8.1f} "
                         f"{r['gb_per_s']:6.0f} {r['cublas_ms'] * 1e3:10.1f} {r['speedup_vs_cublas']:11.2f}x")
            if r.get("ms_by_split_k"):
                cells = ", ".join(f"{s}: {ms * 1e3:.1f}" for s, ms in sorted(r["ms_by_split_k"].items()))
                lines.append(f"  {'':37s} other split_k (us): {cells}")
        elif "skipped" in r:
            lines.append(f"{head}  {r['skipped']}")
        else:
            lines.append(f"{head}  FAILED {r.get('error') or 'rel err %.1e' % r.get('rel_err', float('nan'))}")
    return lines
