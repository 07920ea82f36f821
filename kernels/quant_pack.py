"""The engine's one layout for integer weights (W8A16 / W4A16), and round-to-nearest
quantization into it. Every source (quantize at load, GPTQ, AWQ, compressed-tensors
checkpoints) is converted into this layout once at load; the CPU path and the Triton GEMM
(kernels/quant_gemm.py) read only this.

For a linear layer y = x @ W.T with W [N, K] (out_features, in_features):

    qweight  int32 [K // per_word, N]   per_word = 32 // bits; word r of column n holds
                                        rows k = r * per_word + i at bits [i*bits, (i+1)*bits)
                                        (GPTQ's qweight layout: packed along K)
    scales   [num_groups, N]            the activations' dtype; num_groups = ceil(K / group_size)
    zeros    [num_groups, N]            same dtype as scales, integer-valued in [0, 2**bits]
                                        (2**bits only from GPTQ v1's zero - 1 storage)

    W.T[k, n] = (q[k, n] - zeros[k // group_size, n]) * scales[k // group_size, n]

    input_order  int64 [K] or None      act-order GPTQ only: packed row r holds input feature
                                        input_order[r] (rows sorted by group), so
                                        y = x[..., input_order] @ W.T[input_order]

q is unsigned in [0, 2**bits). Symmetric schemes store zeros = 2**(bits - 1). K must be a
multiple of per_word (8 for int4, 4 for int8); the last group may be shorter than the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (4, 8)
WORD_BITS = 32


def per_word(bits: int) -> int:
    return WORD_BITS // bits


def check_layout(bits: int, group_size: int, in_features: int) -> None:
    """ValueError naming the field when a layer cannot be held in this layout."""
    if bits not in BITS:
        raise ValueError(f"bits={bits}: only {' and '.join(map(str, BITS))}-bit weights are supported")
    if not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size={group_size}: must be a positive integer (in_features for per-channel)")
    if in_features % per_word(bits):
        raise ValueError(f"in_features={in_features}: must be a multiple of {per_word(bits)} "
                         f"to pack {bits}-bit weights into 32-bit words")


@dataclass
class QuantizedWeight:
    """One layer's integer weight in the layout above."""
    qweight: torch.Tensor  # [K // per_word, N] int32
    scales: torch.Tensor  # [num_groups, N]
    zeros: torch.Tensor  # [num_groups, N]
    bits: int
    group_size: int
    in_features: int  # K
    input_order: torch.Tensor | None = None  # [K] int64 (act-order), None: rows in input order

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    def nbytes(self) -> int:
        held = (self.qweight, self.scales, self.zeros) + (() if self.input_order is None else (self.input_order,))
        return sum(t.numel() * t.element_size() for t in held)


def pack_along_k(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[K, N] integers in [0, 2**bits) -> [K // per_word, N] int32 words."""
    k, n = q.shape
    q = q.to(torch.int64).reshape(k // per_word(bits), per_word(bits), n)  # [words, per_word, N]
    shifts = torch.arange(per_word(bits), dtype=torch.int64, device=q.device).view(1, -1, 1) * bits
    words = (q << shifts).sum(dim=1)  # [words, N], in [0, 2**32)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # reinterpret as signed int32


def unpack_along_k(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """[K // per_word, N] int32 words -> [K, N] int32 in [0, 2**bits) (bit-exact inverse)."""
    words, n = qweight.shape
    shifts = torch.arange(per_word(bits), dtype=torch.int32, device=qweight.device).view(1, -1, 1) * bits
    q = (qweight.unsqueeze(1) >> shifts) & ((1 << bits) - 1)  # [words, per_word, N]
    return q.reshape(words * per_word(bits), n)


def group_index(in_features: int, group_size: int, device: torch.device | None = None) -> torch.Tensor:
    return torch.arange(in_features, device=device) // group_size  # [K]


def dequantize(w: QuantizedWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The float weight [N, K] (nn.Linear's layout; a transposed view of [K, N] rows, which
    F.linear takes as it is: a contiguous copy costs more than the GEMM at small batches):
    the reference every path is held to."""
    dtype = dtype or w.scales.dtype
    q = unpack_along_k(w.qweight, w.bits).to(dtype)  # [K, N]
    k, n = q.shape
    zeros, scales = w.zeros.to(dtype), w.scales.to(dtype)  # [G, N]
    if k % w.group_size == 0:  # whole groups: broadcast, not gather (the same products)
        grouped = q.view(k // w.group_size, w.group_size, n)  # [G, group_size, N]
        rows = ((grouped - zeros[:, None, :]) * scales[:, None, :]).view(k, n)  # [K, N], packed rows
    else:
        g = group_index(k, w.group_size, w.qweight.device)  # [K]
        rows = (q - zeros[g]) * scales[g]  # [K, N], packed rows
    if w.input_order is not None:  # back to input order: packed row r is feature input_order[r]
        rows = torch.empty_like(rows).index_copy_(0, w.input_order, rows)
    return rows.t()  # [N, K]


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int | None,
                 symmetric: bool) -> QuantizedWeight:
    """Round-to-nearest quantization of a float weight [N, K]; group_size None is per-channel.
    Symmetric: scale = max|w| / (2**(bits-1) - 1), zero 2**(bits-1). Asymmetric: the group's
    [min, max] (widened to hold 0) onto [0, 2**bits - 1] with an integer zero point."""
    n, k = weight.shape
    group_size = group_size or k
    check_layout(bits, group_size, k)
    w = weight.detach().to(torch.float32).t()  # [K, N]
    groups = -(-k // group_size)
    g = group_index(k, group_size, w.device)
    top = (1 << bits) - 1
    # Zero rows pad the last group: harmless, as every group's range is widened to hold 0.
    padded = torch.cat([w, w.new_zeros(groups * group_size - k, n)]).view(groups, group_size, n)
    lo, hi = padded.amin(dim=1).clamp(max=0.0), padded.amax(dim=1).clamp(min=0.0)  # [G, N]
    if symmetric:
        zeros = torch.full_like(lo, float(1 << (bits - 1)))
        scales = torch.maximum(hi, -lo) / ((1 << (bits - 1)) - 1)
    else:
        scales = (hi - lo) / top
        zeros = torch.round(-lo / torch.where(scales > 0, scales, 1.0)).clamp(0, top)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group
    q = torch.clamp(torch.round(w / scales[g]) + zeros[g], 0, top)  # [K, N]
    out_dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
    return QuantizedWeight(qweight=pack_along_k(q.to(torch.int32), bits), scales=scales.to(out_dtype),
                           zeros=zeros.to(out_dtype), bits=bits, group_size=group_size, in_features=k)
