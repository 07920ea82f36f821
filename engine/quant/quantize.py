"""Quantize at load (`--quantization int8|int4`): once the float checkpoint is loaded, each
decoder layer's linears (qkv, o, gate_up, down) become QuantizedLinear layers, one at a
time, so the float weights are freed as they go and peak memory stays one model plus one
layer's temporaries. The embedding and the LM head stay float, as in vLLM by default.

    int8  W8A16: per output channel, symmetric (zero point 128), round to nearest
    int4  W4A16: groups of 128 input features with an integer zero point (asymmetric),
          round to nearest; a layer whose in_features 128 does not divide gets the largest
          power of two below 128 that does (at least 8: in_features must be a multiple of
          8 to pack), so every group is full, as GPTQ-style kernels expect
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from .linear import QuantizedLinear
from kvpilot.kernels.quant_pack import quantize_rtn

log = logging.getLogger("kvpilot.engine")

# Within each decoder layer: the fused projections models/llama.py builds.
DECODER_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
INT4_GROUP_SIZE = 128


@dataclass(frozen=True)
class Scheme:
    bits: int
    group_size: int | None  # None: per output channel (one group spans in_features)
    symmetric: bool

    def group_for(self, in_features: int) -> int | None:
        """The group size a layer gets: the largest power of two <= group_size dividing in_features."""
        if self.group_size is None:
            return None
        group = self.group_size
        while group > 1 and in_features % group:
            group //= 2
        return group


SCHEMES = {
    "int8": Scheme(bits=8, group_size=None, symmetric=True),
    "int4": Scheme(bits=4, group_size=INT4_GROUP_SIZE, symmetric=False),
}


@dataclass(frozen=True)
class QuantizationSummary:
    method: str
    layers: int  # linear layers converted
    float_bytes: int  # their float weights and biases before
    quantized_bytes: int  # after: integer weights, scales, zeros, biases

    def describe(self) -> str:
        return (f"{self.method} weights in {self.layers} decoder linears "
                f"({self.float_bytes / 2**20:.1f} MiB float -> {self.quantized_bytes / 2**20:.1f} MiB)")


def quantize_linear(linear: nn.Module, method: str, name: str = "linear") -> QuantizedLinear:
    """`linear`'s weight [N, K] round-to-nearest quantized by `method`'s scheme."""
    scheme = SCHEMES[method]
    try:
        weight = quantize_rtn(linear.weight.detach(), scheme.bits, scheme.group_for(linear.in_features),
                              scheme.symmetric)
    except ValueError as e:
        raise ValueError(f"quantization={method!r}: {name}: {e}") from None
    return QuantizedLinear.from_linear(linear, weight)


def quantize_decoder(model: nn.Module, method: str) -> QuantizationSummary:
    """Replace the decoder layers' linears of a loaded LlamaForCausalLM in place."""
    if method not in SCHEMES:
        raise ValueError(f"quantization must be one of {tuple(SCHEMES)}, got {method!r}")
    layers = before = after = 0
    for i, layer in enumerate(model.model.layers):
        for path in DECODER_LINEARS:
            parent_name, _, attr = path.rpartition(".")
            parent = layer.get_submodule(parent_name)
            linear = getattr(parent, attr)
            before += sum(p.numel() * p.element_size() for p in linear.parameters())
            quantized = quantize_linear(linear, method, f"model.layers.{i}.{path}")
            # The float weight's last reference goes with the module: freed before the next.
            setattr(parent, attr, quantized)
            del linear
            layers += 1
            after += quantized.nbytes()
    summary = QuantizationSummary(method, layers, before, after)
    log.info("quantized at load: %s", summary.describe())
    return summary


def weight_bytes(model: nn.Module) -> int:
    """Resident weight bytes: float parameters plus quantized layers' buffers (not other
    buffers, such as the rotary tables)."""
    quantized = sum(m.nbytes() for m in model.modules() if isinstance(m, QuantizedLinear))
    return quantized + sum(p.numel() * p.element_size() for p in model.parameters())
