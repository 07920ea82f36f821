"""Integer-weight GEMM (W4A16 / W8A16): ``y = x @ dequant(W).T (+ bias)``.

Weight layout (``kvpilot.kernels.quant_pack``, the engine's only one): ``qweight`` int32
``[K // per_word, N]`` packed along K (word r of column n holds rows ``k = r * per_word + i``
at bits ``[i*bits, (i+1)*bits)``), ``scales``/``zeros`` ``[num_groups, N]`` in the
activations' dtype, ``num_groups = ceil(K / group_size)`` (the last group may be partial),

    W.T[k, n] = (q[k, n] - zeros[k // group_size, n]) * scales[k // group_size, n]

Design: one program per ``BLOCK_M x BLOCK_N`` output tile, walking K in ``BLOCK_K`` steps.
Each step loads the ``BLOCK_K / per_word x BLOCK_N`` int32 words behind a ``BLOCK_K x
BLOCK_N`` weight tile once, shifts and masks every word into its ``per_word`` rows
(``[words, per_word, BLOCK_N]`` reshaped to ``[BLOCK_K, BLOCK_N]``: row ``r * per_word + i``),
subtracts the zero and multiplies by the scale of the row's group, rounds the tile to the
activations' dtype and feeds it with the ``x`` tile to ``tl.dot`` (fp32
accumulator). When a K tile lies inside one group (``group_size % BLOCK_K == 0``, or a
single group: per-channel) the tile's scales and zeros are one ``[BLOCK_N]`` row; otherwise
they are gathered per K row. Bias is added in fp32 before the output is rounded.

Split-K: at small M the grid has only ``cdiv(N, BLOCK_N)`` programs, too few to keep a GPU's
memory system busy on a layer as small as 4096 x 4096. ``choose_split_k`` then splits K
into ``split_k`` slices (whole K tiles each, never shorter than ``MIN_K_TILES_PER_SPLIT``
tiles); the programs of a tile add their fp32 partial sums atomically into a zeroed fp32
buffer (bias from slice 0 only), which is rounded to the output dtype afterwards. The fp32
sum order then varies from run to run, within the same tolerance.

The dequantized weight is bit-identical to ``dequantize(..., dtype=x.dtype)``: ``q - zero``
is an integer below 2**8 (exact in every dtype), its product with a 16-bit scale has at
most 8 + 11 significant bits (exact in fp32), so rounding that product to fp16/bf16 once
equals the reference's correctly rounded dtype multiply. What separates kernel and
reference is only the fp32 summation order and the final rounding of the output.

Under Triton's interpreter a bf16 cast truncates (the GPU rounds to nearest even), and
bf16 dots cannot run; there (``UPCAST``) the weight tile and the output are rounded to
bf16 precision by hand, in fp32, so the interpreted kernel keeps the GPU's numbers.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvpilot.kernels.quant_pack import BITS, QuantizedWeight, dequantize, per_word
from kvpilot.kernels._common import next_power_of_2, upcast_dots

# Relative error ||out - ref|| / ||ref|| (kvpilot.kernels.testing.rel_error) the kernel may
# show against quant_matmul_reference, per activation dtype. The reference computes in
# float64 from the same dtype-rounded weights (the kernel's weight tiles are bit-identical,
# see above), so the only gaps are:
# (a) the kernel's fp32 accumulation (fp32 dots run with input_precision="ieee", never TF32):
#     rounding errors of order 2**-24 * sqrt(K); measured 2.7e-7 at K = 14336, so fp32's
#     1e-5 leaves a wide margin up to Llama's largest in_features;
# (b) for 16-bit outputs, the final rounding of two sums that differ by (a): they round to
#     the same value except next to a rounding boundary, where they differ by one ulp
#     (2**-11..2**-10 relative in fp16, 2**-8..2**-7 in bf16). fp16's 1e-3 and bf16's 8e-3
#     allow about one ulp on every element, far above the few that straddle (measured: 0
#     to 1e-5 in the tests). The attention kernels use the same fp32/fp16 bounds
#     (kvpilot.kernels._common.KERNEL_RTOL; bf16 1e-2 there, as their P tile is rounded).
QUANT_GEMM_RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}

MAX_SPLIT_K = 16
MIN_K_TILES_PER_SPLIT = 4

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _quant_matmul_kernel(
    x_ptr,  # [M, K]
    qweight_ptr,  # [K // PER_WORD, N] int32
    scales_ptr,  # [num_groups, N]
    zeros_ptr,  # [num_groups, N]
    bias_ptr,  # [N] (unused without HAS_BIAS)
    out_ptr,  # [M, N]; fp32 (zeroed, accumulated atomically) when SPLIT_K > 1
    M, N, K,
    k_per_split,  # K rows per program_id(2) slice, a multiple of BLOCK_K
    stride_xm, stride_xk,
    stride_qk, stride_qn,
    stride_sg, stride_sn,
    stride_zg, stride_zn,
    stride_om, stride_on,
    BITS: tl.constexpr,  # 4 or 8
    PER_WORD: tl.constexpr,  # 32 // BITS
    GROUP_SIZE: tl.constexpr,  # K rows per scale/zero row
    ONE_GROUP: tl.constexpr,  # every K tile lies inside one group
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # >= 16 (tl.dot)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of PER_WORD
    SPLIT_K: tl.constexpr,  # slices of K (program_id(2)); > 1: atomic fp32 adds into out
    UPCAST: tl.constexpr,  # feed fp32 to tl.dot (interpreter + bf16 only)
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_mask = rows < M
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    kws = tl.arange(0, BLOCK_K // PER_WORD)  # [BLOCK_KW]: word rows of a tile
    shifts = tl.arange(0, PER_WORD) * BITS  # [PER_WORD]
    bit_mask = (1 << BITS) - 1

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k_start in range(k_begin, k_end, BLOCK_K):
        k = k_start + ks  # [BLOCK_K]
        k_mask = k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk,
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w_mask = k_mask[:, None] & col_mask[None, :]  # [BLOCK_K, BLOCK_N]
        kw = k_start // PER_WORD + kws  # [BLOCK_KW]; K % PER_WORD == 0, so kw < K // PER_WORD <=> its rows < K
        kw_mask = kw < K // PER_WORD
        words = tl.load(qweight_ptr + kw[:, None] * stride_qk + cols[None, :] * stride_qn,
                        mask=kw_mask[:, None] & col_mask[None, :], other=0)  # [BLOCK_KW, BLOCK_N] int32
        q = (words[:, None, :] >> shifts[None, :, None]) & bit_mask  # [BLOCK_KW, PER_WORD, BLOCK_N]
        q = tl.reshape(q, (BLOCK_K, BLOCK_N)).to(tl.float32)  # [BLOCK_K, BLOCK_N] in [0, 2**BITS)
        if ONE_GROUP:
            g = k_start // GROUP_SIZE
            s = tl.load(scales_ptr + g * stride_sg + cols * stride_sn, mask=col_mask, other=0.0)  # [BLOCK_N]
            z = tl.load(zeros_ptr + g * stride_zg + cols * stride_zn, mask=col_mask, other=0.0)  # [BLOCK_N]
            w = (q - z.to(tl.float32)[None, :]) * s.to(tl.float32)[None, :]  # [BLOCK_K, BLOCK_N]
        else:
            g = k // GROUP_SIZE  # [BLOCK_K]
            s = tl.load(scales_ptr + g[:, None] * stride_sg + cols[None, :] * stride_sn,
                        mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
            z = tl.load(zeros_ptr + g[:, None] * stride_zg + cols[None, :] * stride_zn,
                        mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
            w = (q - z.to(tl.float32)) * s.to(tl.float32)  # [BLOCK_K, BLOCK_N]
        if UPCAST:  # round to nearest even bf16, kept in fp32
            x = x.to(tl.float32)
            w_bits = w.to(tl.int32, bitcast=True)
            w_bits = (w_bits + 0x7FFF + ((w_bits >> 16) & 1)) & -65536
            w = w_bits.to(tl.float32, bitcast=True)
        else:
            w = w.to(x_ptr.dtype.element_ty)  # the reference's one rounding of the weight
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)

    if HAS_BIAS:  # once per output: from K slice 0
        bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)  # [BLOCK_N]
        acc += tl.where(pid_k == 0, bias, 0.0)[None, :]
    o_offs = rows[:, None] * stride_om + cols[None, :] * stride_on
    o_mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(out_ptr + o_offs, acc, mask=o_mask, sem="relaxed")
    else:
        if UPCAST:  # the interpreter's bf16 cast truncates: round to nearest even first
            acc_bits = acc.to(tl.int32, bitcast=True)
            acc = ((acc_bits + 0x7FFF + ((acc_bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


def _launch_config(m: int, n: int, k: int, bits: int) -> dict[str, int]:
    """Tile sizes and launch options, from M alone (no autotuning; gpu_check can sweep
    alternatives by replacing this function).

    Small M (decode) is bandwidth-bound on the weight: a 16-row tile (tl.dot's minimum),
    narrow N tiles so the grid spreads over the SMs, long K steps. Larger M moves toward
    compute-bound square tiles.
    """
    if m <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
    if m <= 64:
        return {"BLOCK_M": max(16, min(64, next_power_of_2(m))), "BLOCK_N": 64, "BLOCK_K": 64,
                "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def choose_split_k(programs: int, k_tiles: int, num_sms: int, *,
                   min_tiles_per_split: int = MIN_K_TILES_PER_SPLIT, max_split: int = MAX_SPLIT_K) -> int:
    """How many K slices to run (pure; no device queries): 1 when the ``programs`` output
    tiles already give every SM two, else enough slices to reach that, each at least
    ``min_tiles_per_split`` K tiles long (the atomic adds and the fp32 buffer's zeroing and
    cast cost more than shorter slices gain)."""
    target = 2 * max(1, num_sms)
    if programs <= 0 or programs >= target or k_tiles < 2 * min_tiles_per_split:
        return 1
    return max(1, min(-(-target // programs), k_tiles // min_tiles_per_split, max_split))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_split_k(m: int, n: int, k: int, bits: int, device: torch.device) -> int:
    """The split ``quant_matmul`` uses when not told: ``choose_split_k`` for the launch
    config's grid on a CUDA device; 1 elsewhere (Triton's interpreter runs programs one
    after another, so splitting only adds work)."""
    if device.type != "cuda" or m == 0 or n == 0 or k == 0:
        return 1
    config = _launch_config(m, n, k, bits)
    programs = triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])
    return choose_split_k(programs, triton.cdiv(k, config["BLOCK_K"]), _num_sms(device))


def _check(x, qweight, scales, zeros, bits, group_size, bias) -> None:
    """ValueError naming the offending argument."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D [M, K] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x dtype {x.dtype}: must be one of {', '.join(map(str, DTYPES))}")
    if bits not in BITS:
        raise ValueError(f"bits={bits}: only {' and '.join(map(str, BITS))}-bit weights are supported")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
        raise ValueError(f"group_size={group_size!r}: must be a positive integer (K for per-channel)")
    m, k = x.shape
    if not isinstance(qweight, torch.Tensor) or qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(f"qweight must be a 2-D int32 [K // {per_word(bits)}, N] tensor, got "
                         f"{getattr(qweight, 'dtype', type(qweight).__name__)} {tuple(getattr(qweight, 'shape', ()))}")
    if k % per_word(bits) or qweight.shape[0] * per_word(bits) != k:
        raise ValueError(f"qweight has {qweight.shape[0]} rows of {per_word(bits)} packed {bits}-bit values; "
                         f"x has K={k} (K must equal rows * {per_word(bits)})")
    n = qweight.shape[1]
    groups = -(-k // group_size)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (groups, n):
            raise ValueError(f"{name} must be [num_groups={groups}, N={n}] (K={k}, group_size={group_size}), "
                             f"got {tuple(getattr(t, 'shape', ()))}")
        if t.dtype != x.dtype:
            raise ValueError(f"{name} dtype {t.dtype} must match x dtype {x.dtype}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,):
            raise ValueError(f"bias must be [N={n}], got {tuple(getattr(bias, 'shape', ()))}")
        if bias.dtype != x.dtype:
            raise ValueError(f"bias dtype {bias.dtype} must match x dtype {x.dtype}")
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")


def quant_matmul(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K // (32 // bits), N] int32
    scales: torch.Tensor,  # [num_groups, N], x's dtype
    zeros: torch.Tensor,  # [num_groups, N], x's dtype (integer-valued)
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
    *,
    split_k: int | None = None,
) -> torch.Tensor:
    """``x @ dequant(W).T (+ bias)`` for an integer weight in quant_pack's layout.
    ``split_k=None`` lets ``choose_split_k`` decide. Returns ``[M, N]`` in x's dtype."""
    _check(x, qweight, scales, zeros, bits, group_size, bias)
    m, k = x.shape
    n = qweight.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    config = dict(_launch_config(m, n, k, bits))
    block_m, block_n, block_k = config.pop("BLOCK_M"), config.pop("BLOCK_N"), config.pop("BLOCK_K")
    upcast = upcast_dots(x.dtype)
    precision = "ieee" if (x.dtype == torch.float32 or upcast) else None
    k_tiles = triton.cdiv(k, block_k)
    if split_k is None:
        split_k = default_split_k(m, n, k, bits, x.device)
    split_k = max(1, min(int(split_k), k_tiles))
    k_per_split = triton.cdiv(k_tiles, split_k) * block_k
    split_k = triton.cdiv(k, k_per_split)  # no empty slice
    dest = torch.zeros(m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out  # [M, N]
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _quant_matmul_kernel[grid](
        x, qweight, scales, zeros, bias if bias is not None else out, dest,
        m, n, k, k_per_split,
        *x.stride(),
        *qweight.stride(),
        *scales.stride(),
        *zeros.stride(),
        *dest.stride(),
        BITS=bits,
        PER_WORD=per_word(bits),
        GROUP_SIZE=group_size,
        ONE_GROUP=group_size % block_k == 0 or group_size >= k,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        **config,  # num_warps, num_stages
    )
    if split_k > 1:
        out.copy_(dest)  # one rounding of the fp32 sums
    return out


def quant_matmul_reference(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K // (32 // bits), N] int32
    scales: torch.Tensor,  # [num_groups, N], x's dtype
    zeros: torch.Tensor,  # [num_groups, N], x's dtype
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
    *,
    split_k: int | None = None,
) -> torch.Tensor:
    """Plain-torch ``quant_matmul``: the weight from ``quant_pack.dequantize`` in x's dtype
    (the engine's float weight), then the product and bias in float64, rounded once to x's
    dtype (``split_k`` is accepted for signature parity and ignored). Returns ``[M, N]``."""
    _check(x, qweight, scales, zeros, bits, group_size, bias)
    weight = QuantizedWeight(qweight=qweight, scales=scales, zeros=zeros, bits=bits, group_size=group_size,
                             in_features=x.shape[1])
    w = dequantize(weight, dtype=x.dtype)  # [N, K]
    y = x.double() @ w.double().t()  # [M, N]
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)
