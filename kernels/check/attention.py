"""The attention part of the GPU check (steps 2 and 3 of kvpilot.kernels.gpu_check): the
device's copy bandwidth, the paged decode kernel's bandwidth on Llama-3-8B's attention shape
over batches and contexts (beside SDPA on a contiguous cache), and one long-prompt prefill."""

from __future__ import annotations

import gc
import time
from typing import Any, Callable

LLAMA3_8B = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXTS = (512, 2048, 8192)


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
