"""A compressed-tensors `pack-quantized` checkpoint's tensors, converted into the engine's one
integer layout (quant_pack.py) as it loads. Per quantized module (W [N, K]):

    weight_packed      int32 [N, K // per_word]   packed along K (compressed_tensors'
                                                  pack_to_int32): value i of a word at bits
                                                  [i*bits, (i+1)*bits), stored as
                                                  q + 2**(bits-1) with q signed
    weight_scale       [N, num_groups]            (channel: [N, 1])
    weight_zero_point  int32 [ceil(N / per_word), num_groups]   asymmetric only: the signed
                                                  zero point + 2**(bits-1), packed along N
    weight_shape       int64 [2]                  (N, K)

    W[n, k] = (q[n, k] - zp[n, g]) * scale[n, g],  g = k // group_size

For 4 and 8 bits that word layout is quant_pack's on W.T: the engine's qweight is
weight_packed transposed, bit for bit, and its zeros are the unsigned zero points
(2**(bits-1) when symmetric). q/k/v and gate/up are fused by concatenating along N.
"""

from __future__ import annotations

import logging
from typing import Iterable, Iterator

import torch
from torch import nn

from .quant_compressed_tensors import CompressedTensorsConfig, WeightScheme, decoder_in_features, decoder_plan
from .quant_linear import QuantizedLinear
from .quant_pack import QuantizedWeight, per_word, unpack_along_k
from .quantization import QuantizationSummary

log = logging.getLogger("kvpilot.engine")

# The engine's decoder linears (quantization.DECODER_LINEARS) and the checkpoint modules in them.
FUSED_SOURCES = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "self_attn.o_proj": ("o_proj",),
                 "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ("down_proj",)}


def convert(name: str, tensors: dict[str, torch.Tensor], scheme: WeightScheme,
            dtype: torch.dtype) -> QuantizedWeight:
    """One checkpoint module's tensors (by leaf name) -> a QuantizedWeight, scales and zeros
    in `dtype`; ValueError naming the tensor when one is missing or malformed."""
    bits = scheme.bits
    needed = ["weight_packed", "weight_scale", "weight_shape"] + (
        [] if scheme.symmetric else ["weight_zero_point"])
    missing = [f"{name}.{leaf}" for leaf in needed if leaf not in tensors]
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {missing} ({scheme.field}: {scheme.describe()})")
    shape = tensors["weight_shape"]
    if shape.numel() != 2:
        raise ValueError(f"tensor {name}.weight_shape={shape.tolist()}: expected [out_features, in_features]")
    n, k = (int(v) for v in shape.tolist())
    group = scheme.group_for(k)
    groups = k // group
    packed = tensors["weight_packed"]  # [N, K // per_word] int32
    _expect(f"{name}.weight_packed", packed, (n, k // per_word(bits)), torch.int32)
    scale = tensors["weight_scale"]  # [N, num_groups]
    _expect(f"{name}.weight_scale", scale, (n, groups), None)
    if scheme.symmetric:
        zeros = torch.full((groups, n), float(1 << (bits - 1)), dtype=dtype)  # [G, N]
    else:
        zp = tensors["weight_zero_point"]  # [ceil(N / per_word), G] int32, packed along N
        _expect(f"{name}.weight_zero_point", zp, (-(-n // per_word(bits)), groups), torch.int32)
        zeros = unpack_along_k(zp, bits)[:n].t().to(dtype)  # [G, N], already unsigned
    return QuantizedWeight(qweight=packed.t().contiguous(), scales=scale.t().to(dtype).contiguous(),
                           zeros=zeros.contiguous(), bits=bits, group_size=group, in_features=k)


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None) -> None:
    if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype):
        raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)} and dtype {t.dtype}, expected "
                         f"{shape}{f' and {dtype}' if dtype else ''}")
    if dtype is None and not t.dtype.is_floating_point:
        raise ValueError(f"tensor {name!r} has dtype {t.dtype}, expected a float")


def fuse(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Layers sharing x (q/k/v, gate/up) as one: their output columns side by side."""
    first = parts[0]
    if any((p.bits, p.group_size, p.in_features) != (first.bits, first.group_size, first.in_features)
           for p in parts):
        raise ValueError("fused parts must share bits, group size and in_features")
    return QuantizedWeight(qweight=torch.cat([p.qweight for p in parts], dim=1),  # [K // per_word, sum N]
                           scales=torch.cat([p.scales for p in parts], dim=1),  # [G, sum N]
                           zeros=torch.cat([p.zeros for p in parts], dim=1),  # [G, sum N]
                           bits=first.bits, group_size=first.group_size, in_features=first.in_features)


def load_compressed_tensors(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                            ct: CompressedTensorsConfig) -> QuantizationSummary:
    """Load a checkpoint into a built LlamaForCausalLM: float tensors through its
    load_weights, the quantized decoder linears as QuantizedLinear layers."""
    cfg = model.config
    plan = decoder_plan(ct, cfg.num_hidden_layers, decoder_in_features(cfg))
    dtype = model.model.embed_tokens.weight.dtype
    device = model.model.embed_tokens.weight.device
    # The quantized linears leave the model before loading, so load_weights neither expects
    # their float weights nor sees their tensors: those are kept here until all have come.
    detached: list[tuple[nn.Module, str, str, bool]] = []  # (parent, engine path, source prefix, bias)
    for i, layer in enumerate(model.model.layers):
        for path, sources in FUSED_SOURCES.items():
            parent_name, _, attr = path.rpartition(".")
            if plan[f"model.layers.{i}.{parent_name}.{sources[0]}"] is None:
                continue
            parent = layer.get_submodule(parent_name)
            has_bias = getattr(parent, attr).bias is not None
            detached.append((parent, path, f"model.layers.{i}.{parent_name}", has_bias))
            setattr(parent, attr, None)  # frees the float weight allocated by build()
    quantized = {name for name, scheme in plan.items() if scheme is not None}
    kept: dict[str, dict[str, torch.Tensor]] = {name: {} for name in quantized}
    model.load_weights(_float_tensors(weights, kept))
    layers = before = after = 0
    for parent, path, prefix, has_bias in detached:
        parts, biases = [], []
        for source in FUSED_SOURCES[path]:
            name = f"{prefix}.{source}"
            tensors = kept.pop(name)
            allowed = {"weight_packed", "weight_scale", "weight_shape"} | (
                set() if plan[name].symmetric else {"weight_zero_point"}) | ({"bias"} if has_bias else set())
            unexpected = sorted(set(tensors) - allowed)
            if unexpected:
                raise ValueError(f"checkpoint has unexpected tensors {[f'{name}.{u}' for u in unexpected]} "
                                 f"for a {plan[name].describe()} layer")
            if has_bias and "bias" not in tensors:
                raise ValueError(f"checkpoint is missing tensors: ['{name}.bias']")
            parts.append(convert(name, tensors, plan[name], dtype))
            biases.append(tensors.get("bias"))
        weight = fuse(parts)
        weight = QuantizedWeight(weight.qweight.to(device), weight.scales.to(device), weight.zeros.to(device),
                                 weight.bits, weight.group_size, weight.in_features)
        bias = torch.cat(biases).to(device, dtype) if has_bias else None  # [sum N]
        linear = QuantizedLinear(weight, bias)
        setattr(parent, path.rpartition(".")[2], linear)
        layers += 1
        # `before`: what the float layer would hold, for the summary's comparison.
        before += weight.out_features * weight.in_features * dtype.itemsize + (
            bias.numel() * bias.element_size() if bias is not None else 0)
        after += linear.nbytes()
    summary = QuantizationSummary(f"compressed-tensors ({ct.describe()})", layers, before, after)
    log.info("read a quantized checkpoint: %s", summary.describe())
    return summary


def _float_tensors(weights: Iterable[tuple[str, torch.Tensor]],
                   kept: dict[str, dict[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors but the quantized modules', which go into `kept`."""
    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        if module in kept:
            kept[module][leaf] = tensor
        else:
            yield name, tensor
