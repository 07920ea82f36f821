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
        rows = x.shape[0]
        padded = padded_rows(rows) if x.dim() == 2 else rows
        if padded != rows:  # zero rows on the end; the output's first rows are the same
            x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])  # [padded, in]
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return out[:rows] if padded != rows else out  # [rows, out] (contiguous)


# oneDNN (and ideep's cache in front of it) keeps a primitive with its own scratch memory
# for every row count a weight has seen: over the five matmul shapes of a 55M-parameter
# Llama about 3.6 MiB per new count up to 64 rows and 15 MiB above. A server sees every
# count from 1 to the batched-token budget, so its memory grew without bound in practice
# (one process: +3.8 GiB over the counts 1..2048; bench soak on builtin:tiny: +19 % after
# warm-up). Up to 64 rows (decode batches, where a padded row costs real time) counts stay
# exact; above, they are rounded up to 8 buckets per doubling (multiples of 8 up to 128,
# of 16 up to 256, ...), so powers of two such as the 2048 budget stay exact, a step pays
# at most 12.5 % more rows in its matmuls, and 1..2048 rows make 64 + 40 primitives.
EXACT_ROWS = 64


def padded_rows(rows: int) -> int:
    """The row count a matmul of `rows` runs at."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << ((rows - 1).bit_length() - 4)  # rows in (2^k, 2^(k+1)]: 2^(k+1) / 8
    return -(-rows // step) * step


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
