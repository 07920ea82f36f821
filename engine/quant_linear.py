"""A linear layer over an integer weight (quant_pack's layout): what quantize-at-load
(quantization.py) puts in place of the decoder's nn.Linear layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .quant_pack import QuantizedWeight, dequantize


class QuantizedLinear(nn.Module):
    """`nn.Linear`'s forward (y = x @ W.T + b) with W held as integers: resident memory is
    the packed weight, its scales and zeros, never the float weight."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bits, self.group_size = weight.bits, weight.group_size
        # Not persistent: these are not a checkpoint's tensor names.
        self.register_buffer("qweight", weight.qweight, persistent=False)  # [K // per_word, N] int32
        self.register_buffer("scales", weight.scales, persistent=False)  # [num_groups, N]
        self.register_buffer("zeros", weight.zeros, persistent=False)  # [num_groups, N]
        self.register_buffer("bias", bias, persistent=False)  # [N] or None
        self.register_buffer("input_order", weight.input_order, persistent=False)  # [K] int64 or None

    @classmethod
    def from_linear(cls, linear: nn.Module, weight: QuantizedWeight) -> QuantizedLinear:
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls(weight, bias)

    def quantized(self) -> QuantizedWeight:
        return QuantizedWeight(qweight=self.qweight, scales=self.scales, zeros=self.zeros, bits=self.bits,
                               group_size=self.group_size, in_features=self.in_features,
                               input_order=self.input_order)

    def nbytes(self) -> int:
        """Resident bytes: the integer weight, its scales and zeros, and the bias."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if x.is_cuda:
            return self.forward_gemm(x)
        # The CPU: this one layer's float weight [N, K] exists for this call only.
        return F.linear(x, dequantize(self.quantized(), x.dtype), self.bias)

    def forward_gemm(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        """Through the Triton integer-weight GEMM (on CUDA; the tests run it in Triton's
        interpreter on the CPU). Imported here: the engine imports without Triton."""
        from kvpilot.kernels.quant_gemm import quant_matmul

        if self.input_order is not None:  # act-order: the packed rows' order of input features
            x = x.index_select(-1, self.input_order)
        out = quant_matmul(x.reshape(-1, self.in_features), self.qweight, self.scales, self.zeros,
                           self.bits, self.group_size, self.bias)  # [M, N]
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, bias={self.bias is not None}, "
                f"act_order={self.input_order is not None}")
