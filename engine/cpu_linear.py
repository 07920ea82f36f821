"""Linear layers on the CPU through oneDNN with the weight reordered once at load (what
vLLM's CPU backend does too): the decode-sized matmuls (a few to a few dozen rows against
a large weight) and the LM head run faster than through `F.linear`'s BLAS call.

Only float32 on the CPU, and only when this torch has the oneDNN ops; otherwise every
layer stays an `nn.Linear` (the caller logs which)."""

from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward with the weight in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # [out, in] reordered for oneDNN; the original weight is not kept.
        self.register_buffer("packed_weight",
                             torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None),
                             persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def packed_linear_available(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    try:  # the ops are torch-internal (Inductor's CPU path): probe them once
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8), None)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8), w, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return bool(torch.allclose(out, torch.full((2, 8), 8.0)))


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of `model` by a PackedLinear; return how many. A tied LM
    head gets its own packed copy (the embedding keeps the plain weight)."""
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for name, mod in targets:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, PackedLinear(mod))
    return len(targets)
