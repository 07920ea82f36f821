"""A linear layer over an integer weight (quant_pack's layout): what quantize-at-load
(quantization.py) and the quantized-checkpoint loader put in place of the decoder's
nn.Linear layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.kernels.quant_pack import QuantizedWeight, dequantize, pack_along_k, unpack_along_k

INT8_ZERO = 128  # a symmetric 8-bit weight's zero point in quant_pack's unsigned layout


def _int8_channel_weight(w: QuantizedWeight) -> torch.Tensor | None:
    """W.T [K, N] as signed int8 for a per-channel symmetric 8-bit layer on the CPU (one
    scale per output channel, no zero point to subtract), else None."""
    if (w.qweight.device.type != "cpu" or w.bits != 8 or w.group_size < w.in_features
            or w.input_order is not None or not bool((w.zeros == INT8_ZERO).all())):
        return None
    return (unpack_along_k(w.qweight, 8) - INT8_ZERO).to(torch.int8)  # [K, N]


class QuantizedLinear(nn.Module):
    """`nn.Linear`'s forward (y = x @ W.T + b) with W held as integers: resident memory is
    the packed weight, its scales and zeros, never the float weight."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bits, self.group_size = weight.bits, weight.group_size
        # Per-channel symmetric int8 on the CPU is held as int8 [K, N] (as many bytes as the
        # packed words): its float weight is one convert and one multiply per call, several
        # times cheaper than unpacking words, and the same floats in the same layout.
        # quantized() packs it back when asked. (torch's _weight_int8pack_mm was slower
        # from 3 rows up on this CPU: its time grows with each row.)
        int8 = _int8_channel_weight(weight)
        # Not persistent: these are not a checkpoint's tensor names.
        self.register_buffer("int8_weight", int8, persistent=False)  # [K, N] int8 or None
        self.register_buffer("qweight", weight.qweight if int8 is None else None,
                             persistent=False)  # [K // per_word, N] int32
        self.register_buffer("scales", weight.scales, persistent=False)  # [num_groups, N]
        self.register_buffer("zeros", weight.zeros, persistent=False)  # [num_groups, N]
        self.register_buffer("bias", bias, persistent=False)  # [N] or None
        self.register_buffer("input_order", weight.input_order, persistent=False)  # [K] int64 or None

    @classmethod
    def from_linear(cls, linear: nn.Module, weight: QuantizedWeight) -> QuantizedLinear:
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls(weight, bias)

    def quantized(self) -> QuantizedWeight:
        qweight = self.qweight
        if qweight is None:  # held as int8 [K, N]
            qweight = pack_along_k(self.int8_weight.to(torch.int32) + INT8_ZERO, 8)
        return QuantizedWeight(qweight=qweight, scales=self.scales, zeros=self.zeros, bits=self.bits,
                               group_size=self.group_size, in_features=self.in_features,
                               input_order=self.input_order)

    def nbytes(self) -> int:
        """Resident bytes: the integer weight, its scales and zeros, and the bias."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if x.is_cuda:
            return self.forward_gemm(x)
        # The CPU: this one layer's float weight [N, K] exists for this call only.
        if self.int8_weight is not None:
            weight = (self.int8_weight.to(x.dtype) * self.scales[0].to(x.dtype)).t()  # [N, K]
        else:
            weight = dequantize(self.quantized(), x.dtype)  # [N, K]
        return F.linear(x, weight, self.bias)

    def forward_gemm(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        """Through the Triton integer-weight GEMM (on CUDA; the tests run it in Triton's
        interpreter on the CPU). Imported here: the engine imports without Triton."""
        from kvpilot.kernels.quant_gemm import quant_matmul

        if self.input_order is not None:  # act-order: the packed rows' order of input features
            x = x.index_select(-1, self.input_order)
        w = self.quantized()
        out = quant_matmul(x.reshape(-1, self.in_features), w.qweight, self.scales, self.zeros,
                           self.bits, self.group_size, self.bias)  # [M, N]
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, bias={self.bias is not None}, "
                f"act_order={self.input_order is not None}, "
                f"held_as_int8={self.int8_weight is not None}")
