"""gpu_check's first part: every kernel against its torch reference (and the reference
against float64 dense attention) over head dims, block sizes, GQA ratios and dtypes,
with NaN-poisoned cache tails and outputs, and over an fp8 cache (e4m3 with non-unit K/V
scales; the dense oracle reads its dequantized twin). Small shapes under the interpreter
on CPU."""

from __future__ import annotations

import time
import traceback
from typing import Any


def _correctness_cases(cpu: bool) -> list[dict[str, Any]]:
    """Cases for every kernel; small under the interpreter, broad on a GPU."""
    import torch

    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    cases: list[dict[str, Any]] = []
    if cpu:
        spec = [  # (head_dim, block_size, heads, kv_heads, dtype)
            (32, 16, 4, 1, f32),
            (80, 8, 2, 2, bf16),
        ]
        long_len = 40
    else:
        spec = []
        blocks, groups = (8, 16, 32), ((8, 8), (8, 2), (8, 1))  # GQA 1, 4, 8
        i = 0
        for head_dim in (32, 64, 80, 96, 128, 256):
            for dtype in (f16, bf16, f32):
                heads, kv_heads = groups[i % 3]
                spec.append((head_dim, blocks[(i // 3 + i) % 3], heads, kv_heads, dtype))
                i += 1
        long_len = 3000
    for n, (head_dim, block_size, heads, kv_heads, dtype) in enumerate(spec):
        bs = block_size
        shape = {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim, "block_size": bs, "dtype": dtype}
        decode_lens = [1, bs - 1, bs, bs + 1, long_len]
        cases.append({"kernel": "decode", "seq_lens": decode_lens, "num_splits": None, **shape})
        cases.append({"kernel": "decode", "seq_lens": decode_lens, "num_splits": 3 + n % 5, **shape})
        cases.append({
            "kernel": "prefill",
            "seq_lens": [1, bs + 1, 2 * bs + 5, long_len, bs],
            "query_lens": [1, 1, bs + 2, min(long_len, 2 * bs + 7), bs],  # decode rows, mid-block prefixes
            **shape,
        })
        cases.append({"kernel": "write", "seq_lens": [bs + 3, long_len], "query_lens": [bs + 3, 1], **shape})
    # An fp8 cache (--kv-cache-dtype fp8) under 16-bit queries: the GPU's own e4m3 conversions.
    fp8_spec = [(64, 16, 4, 1, f16)] if cpu else [(128, 16, 32, 8, bf16), (128, 16, 32, 8, f16), (64, 32, 8, 1, bf16)]
    for head_dim, bs, heads, kv_heads, dtype in fp8_spec:
        shape = {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim, "block_size": bs,
                 "dtype": dtype, "kv_scales": (0.37, 1.9)}
        cases.append({"kernel": "decode", "seq_lens": [1, bs + 1, long_len], "num_splits": None, **shape})
        cases.append({"kernel": "decode", "seq_lens": [bs - 1, long_len], "num_splits": 4, **shape})
        cases.append({"kernel": "prefill", "seq_lens": [1, 2 * bs + 5, long_len],
                      "query_lens": [1, bs + 2, min(long_len, 2 * bs + 7)], **shape})
        cases.append({"kernel": "write", "seq_lens": [bs + 3, long_len], "query_lens": [bs + 3, 1], **shape})
    return cases


def _run_correctness_case(case: dict[str, Any], device: str) -> dict[str, Any]:
    import torch

    from kvpilot.kernels._common import KERNEL_RTOL, REFERENCE_RTOL
    from kvpilot.kernels.kv_cache_write import write_kv_cache, write_kv_cache_reference
    from kvpilot.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_reference
    from kvpilot.kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_reference
    from kvpilot.kernels.testing import dense_attention_float64, fp8_case, make_paged_case, rel_error

    kernel, dtype = case["kernel"], case["dtype"]
    seq_lens = case["seq_lens"]
    query_lens = case.get("query_lens", [1] * len(seq_lens))
    shape = {k: case[k] for k in ("num_heads", "num_kv_heads", "head_dim", "block_size")}
    row = {
        "kernel": kernel,
        "dtype": str(dtype).removeprefix("torch."),
        **shape,
        "group": shape["num_heads"] // shape["num_kv_heads"],
        "seq_lens": seq_lens,
        "query_lens": query_lens,
    }
    p = make_paged_case(seq_lens, query_lens, dtype=dtype, device=device, seed=len(str(case)),
                        write_new=kernel != "write", **shape)
    k_scale, v_scale = case.get("kv_scales", (1.0, 1.0))
    twin = p
    if "kv_scales" in case:
        row["cache_dtype"] = "fp8"
        p, twin = fp8_case(p, k_scale, v_scale)
    if kernel == "write" and "kv_scales" in case:
        kk, vk = p.k_cache.clone(), p.v_cache.clone()
        write_kv_cache(p.key, p.value, kk, vk, p.slot_mapping, k_scale, v_scale)
        kr, vr = p.k_cache.clone(), p.v_cache.clone()
        write_kv_cache_reference(p.key, p.value, kr, vr, p.slot_mapping, k_scale, v_scale)
        ok = torch.equal(kk.view(torch.uint8), kr.view(torch.uint8)) and torch.equal(vk.view(torch.uint8),
                                                                                       vr.view(torch.uint8))
        row.update(kernel_vs_ref=0.0 if ok else float("inf"), ref_vs_dense=0.0, kernel_tol=0.0, ref_tol=0.0, ok=ok)
        return row
    if kernel == "write":
        full = make_paged_case(seq_lens, query_lens, dtype=dtype, device=device, seed=len(str(case)), **shape)
        kk, vk = p.k_cache.clone(), p.v_cache.clone()
        write_kv_cache(p.key, p.value, kk, vk, p.slot_mapping)
        kr, vr = p.k_cache.clone(), p.v_cache.clone()
        write_kv_cache_reference(p.key, p.value, kr, vr, p.slot_mapping)

        def same(a, b):
            return bool(((a == b) | (a.isnan() & b.isnan())).all())

        ok = same(kk, kr) and same(vk, vr) and same(kr, full.k_cache) and same(vr, full.v_cache)
        row.update(kernel_vs_ref=0.0 if ok else float("inf"), ref_vs_dense=0.0, kernel_tol=0.0, ref_tol=0.0, ok=ok)
        return row
    out = torch.full_like(p.query, float("nan"))
    if kernel == "decode":
        args = (p.query, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, p.scale)
        paged_decode_attention(*args, case["num_splits"], out=out, k_scale=k_scale, v_scale=v_scale)
        ref = paged_decode_attention_reference(*args, k_scale=k_scale, v_scale=v_scale)
        row["num_splits"] = case["num_splits"]
    else:
        args = (p.query, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, p.query_start_loc, p.max_query_len, p.scale)
        paged_prefill_attention(*args, out=out, k_scale=k_scale, v_scale=v_scale)
        ref = paged_prefill_attention_reference(*args, k_scale=k_scale, v_scale=v_scale)
    dense = dense_attention_float64(twin)
    k_err, r_err = rel_error(out, ref), rel_error(ref, dense)
    row.update(
        kernel_vs_ref=k_err,
        ref_vs_dense=r_err,
        kernel_tol=KERNEL_RTOL[dtype],
        ref_tol=REFERENCE_RTOL[dtype],
        ok=bool(k_err <= KERNEL_RTOL[dtype] and r_err <= REFERENCE_RTOL[dtype]),
    )
    return row


def run_correctness(cpu: bool, device: str, deadline: float = float("inf")) -> list[dict[str, Any]]:
    """Every case's row; cases not started by ``deadline`` are listed as skipped."""
    rows = []
    for case in _correctness_cases(cpu):
        if time.monotonic() > deadline:
            rows.append({"kernel": case["kernel"], "dtype": str(case["dtype"]).removeprefix("torch."),
                         "head_dim": case["head_dim"], "skipped": "out of time budget"})
            continue
        try:
            rows.append(_run_correctness_case(case, device))
        except Exception as exc:  # a crash is a failed case, reported with the rest
            rows.append({"kernel": case["kernel"], "dtype": str(case["dtype"]), "ok": False,
                         "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
    return rows
