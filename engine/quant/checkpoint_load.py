"""A quantized checkpoint's tensors (compressed-tensors pack-quantized, GPTQ, AWQ GEMM),
converted into the engine's one integer layout (quant_pack.py: qweight [K // per_word, N]
packed along K, scales and unsigned zeros [num_groups, N]) as they load. Per quantized
module, W [N, K] (out_features, in_features), per_word = 32 // bits, g = k // group_size:

compressed-tensors
    weight_packed      int32 [N, K // per_word]   packed along K (value i of a word at bits
                                                  [i*bits, (i+1)*bits)), stored as q + 2**(bits-1)
                                                  with q signed: quant_pack's layout on W.T
    weight_scale       [N, num_groups]            (channel: [N, 1])
    weight_zero_point  int32 [ceil(N / per_word), num_groups]   asymmetric only: the signed
                                                  zero point + 2**(bits-1), packed along N
    weight_shape       int64 [2]                  (N, K)

GPTQ (4 or 8 bits)
    qweight  int32 [K // per_word, N]   packed along K: quant_pack's layout as it is
    qzeros   int32 [num_groups, N // per_word]   packed along N; checkpoint_format gptq (v1)
                                        stores zero - 1 (read back as v + 1, unmasked, as
                                        AutoGPTQ and vLLM do), gptq_v2 the zero itself
    scales   float16 [num_groups, N]
    g_idx    int32 [K]                  each input row's group: k // group_size, or with
                                        act-order (desc_act) a permutation of that; the rows
                                        are then sorted by group and the layer keeps the
                                        order to gather its input features by (input_order)

AWQ GEMM (4 bits)
    qweight  int32 [K, N // 8]          packed along N in AWQ's order: nibble i of word j
                                        holds column 8 j + (0, 2, 4, 6, 1, 3, 5, 7)[i]
    qzeros   int32 [num_groups, N // 8] the same packing
    scales   float16 [num_groups, N]

    W[n, k] = (q[k, n] - zero[g, n]) * scale[g, n]

q/k/v and gate/up are fused by concatenating along N.
"""

from __future__ import annotations

import logging
from typing import Iterable, Iterator

import torch
from torch import nn

from .checkpoint import CheckpointQuantization, WeightScheme, decoder_in_features, decoder_plan
from .linear import QuantizedLinear
from kvpilot.kernels.quant_pack import QuantizedWeight, pack_along_k, per_word, unpack_along_k
from .quantize import QuantizationSummary

log = logging.getLogger("kvpilot.engine")

# The engine's decoder linears (quantization.DECODER_LINEARS) and the checkpoint modules in them.
FUSED_SOURCES = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "self_attn.o_proj": ("o_proj",),
                 "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ("down_proj",)}


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its 8


def convert(qc: CheckpointQuantization, name: str, tensors: dict[str, torch.Tensor], scheme: WeightScheme,
            in_features: int, dtype: torch.dtype) -> QuantizedWeight:
    """One checkpoint module's tensors (by leaf name) -> a QuantizedWeight, scales and zeros
    in `dtype`; ValueError naming the tensor when one is missing or malformed."""
    missing = sorted(f"{name}.{leaf}" for leaf in qc.leaves(scheme) if leaf not in tensors)
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {missing} ({scheme.field}: {scheme.describe()})")
    if qc.method == "gptq":
        return _gptq(name, tensors, scheme, in_features, dtype, v1_zeros=qc.v1_zeros, act_order=qc.act_order)
    if qc.method == "awq":
        return _awq(name, tensors, scheme, in_features, dtype)
    return _compressed_tensors(name, tensors, scheme, dtype)


def _compressed_tensors(name: str, tensors: dict[str, torch.Tensor], scheme: WeightScheme,
                        dtype: torch.dtype) -> QuantizedWeight:
    bits = scheme.bits
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


def _gptq(name: str, tensors: dict[str, torch.Tensor], scheme: WeightScheme, k: int,
          dtype: torch.dtype, v1_zeros: bool, act_order: bool) -> QuantizedWeight:
    bits, pw = scheme.bits, per_word(scheme.bits)
    group = scheme.group_for(k)
    groups = -(-k // group)
    qweight = tensors["qweight"]  # [K // per_word, N] int32
    if qweight.dim() != 2:
        raise ValueError(f"tensor {name}.qweight has shape {tuple(qweight.shape)}, expected [K // {pw}, N]")
    n = qweight.shape[1]
    _expect(f"{name}.qweight", qweight, (k // pw, n), torch.int32)
    if n % pw:
        raise ValueError(f"{name}: out_features {n} is not a multiple of {pw} (qzeros pack {pw} to a word)")
    _expect(f"{name}.qzeros", tensors["qzeros"], (groups, n // pw), torch.int32)
    _expect(f"{name}.scales", tensors["scales"], (groups, n), None)
    order = _act_order(name, tensors.get("g_idx"), k, group, act_order)
    if order is not None:  # rows sorted by group, so each group's rows are contiguous
        qweight = pack_along_k(unpack_along_k(qweight, bits).index_select(0, order), bits)
    zeros = unpack_along_k(tensors["qzeros"].t().contiguous(), bits).t()  # [G, N], packed along N
    if v1_zeros:
        zeros = zeros + 1  # may reach 2**bits: v1's known overflow, read as AutoGPTQ and vLLM do
    return QuantizedWeight(qweight=qweight.contiguous(), scales=tensors["scales"].to(dtype).contiguous(),
                           zeros=zeros.to(dtype).contiguous(), bits=bits, group_size=group, in_features=k,
                           input_order=order)


def _act_order(name: str, g_idx: torch.Tensor | None, k: int, group: int, act_order: bool) -> torch.Tensor | None:
    """The input order that makes g_idx's groups contiguous (int64 [K]), None when they are
    already (k // group_size; static groups); ValueError naming the tensor otherwise."""
    if g_idx is None:
        if act_order:
            raise ValueError(f"checkpoint is missing tensors: ['{name}.g_idx'] (desc_act true needs it)")
        return None
    _expect(f"{name}.g_idx", g_idx, (k,), torch.int32)
    contiguous = torch.arange(k, dtype=torch.int32) // group  # [K]
    if torch.equal(g_idx, contiguous):
        return None
    order = torch.argsort(g_idx, stable=True)  # [K] int64
    if not torch.equal(g_idx[order], contiguous):
        raise ValueError(f"tensor {name}.g_idx does not give every group group_size={group} rows")
    return order


def _unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """[R, C // 8] int32 in AWQ's order -> [R, C] int32 in [0, 16)."""
    r, c = words.shape
    nibbles = unpack_along_k(words.reshape(1, -1), 4).reshape(8, r, c)  # nibble i of each word
    out = torch.empty(r, c, 8, dtype=torch.int32, device=words.device)
    for i, column in enumerate(AWQ_ORDER):
        out[:, :, column] = nibbles[i]
    return out.reshape(r, c * 8)


def _awq(name: str, tensors: dict[str, torch.Tensor], scheme: WeightScheme, k: int,
         dtype: torch.dtype) -> QuantizedWeight:
    group = scheme.group_for(k)
    qweight = tensors["qweight"]  # [K, N // 8] int32, packed along N
    if qweight.dim() != 2:
        raise ValueError(f"tensor {name}.qweight has shape {tuple(qweight.shape)}, expected [K, N // 8]")
    n = qweight.shape[1] * 8
    _expect(f"{name}.qweight", qweight, (k, n // 8), torch.int32)
    _expect(f"{name}.qzeros", tensors["qzeros"], (k // group, n // 8), torch.int32)
    _expect(f"{name}.scales", tensors["scales"], (k // group, n), None)
    q = _unpack_awq(qweight)  # [K, N]
    zeros = _unpack_awq(tensors["qzeros"])  # [G, N]
    return QuantizedWeight(qweight=pack_along_k(q, 4), scales=tensors["scales"].to(dtype).contiguous(),
                           zeros=zeros.to(dtype).contiguous(), bits=4, group_size=group, in_features=k)


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None) -> None:
    if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype):
        raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)} and dtype {t.dtype}, expected "
                         f"{shape}{f' and {dtype}' if dtype else ''}")
    if dtype is None and not t.dtype.is_floating_point:
        raise ValueError(f"tensor {name!r} has dtype {t.dtype}, expected a float")


def fuse(parts: list[QuantizedWeight], name: str = "fused parts") -> QuantizedWeight:
    """Layers sharing x (q/k/v, gate/up) as one: their output columns side by side. `name`:
    the parts, for messages."""
    first = parts[0]
    if any((p.bits, p.group_size, p.in_features) != (first.bits, first.group_size, first.in_features)
           for p in parts):
        raise ValueError(f"{name} must share bits, group size and in_features")
    if any((p.input_order is None) != (first.input_order is None)
           or (p.input_order is not None and not torch.equal(p.input_order, first.input_order)) for p in parts):
        # GPTQ orders a layer's inputs by its Hessian, which q/k/v (and gate/up) share.
        raise ValueError(f"{name} must share one act-order (g_idx) permutation")
    return QuantizedWeight(qweight=torch.cat([p.qweight for p in parts], dim=1),  # [K // per_word, sum N]
                           scales=torch.cat([p.scales for p in parts], dim=1),  # [G, sum N]
                           zeros=torch.cat([p.zeros for p in parts], dim=1),  # [G, sum N]
                           bits=first.bits, group_size=first.group_size, in_features=first.in_features,
                           input_order=first.input_order)


def load_quantized_checkpoint(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                              qc: CheckpointQuantization) -> QuantizationSummary:
    """Load a checkpoint into a built LlamaForCausalLM: float tensors through its
    load_weights, the quantized decoder linears as QuantizedLinear layers."""
    cfg = model.config
    in_features = decoder_in_features(cfg)
    plan = decoder_plan(qc, cfg.num_hidden_layers, in_features)
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
            # g_idx: GPTQ's per-row group, checked in convert (only k // group_size is read).
            allowed = set(qc.leaves(plan[name])) | ({"g_idx"} if qc.method == "gptq" else set()) | (
                {"bias"} if has_bias else set())
            unexpected = sorted(set(tensors) - allowed)
            if unexpected:
                raise ValueError(f"checkpoint has unexpected tensors {[f'{name}.{u}' for u in unexpected]} "
                                 f"for a {plan[name].describe()} layer")
            if has_bias and "bias" not in tensors:
                raise ValueError(f"checkpoint is missing tensors: ['{name}.bias']")
            parts.append(convert(qc, name, tensors, plan[name], in_features[name.split(".", 3)[-1]], dtype))
            biases.append(tensors.get("bias"))
        weight = fuse(parts, f"{prefix}.{{{','.join(FUSED_SOURCES[path])}}}")
        weight = QuantizedWeight(weight.qweight.to(device), weight.scales.to(device), weight.zeros.to(device),
                                 weight.bits, weight.group_size, weight.in_features,
                                 None if weight.input_order is None else weight.input_order.to(device))
        bias = torch.cat(biases).to(device, dtype) if has_bias else None  # [sum N]
        linear = QuantizedLinear(weight, bias)
        setattr(parent, path.rpartition(".")[2], linear)
        layers += 1
        # `before`: what the float layer would hold, for the summary's comparison.
        before += weight.out_features * weight.in_features * dtype.itemsize + (
            bias.numel() * bias.element_size() if bias is not None else 0)
        after += linear.nbytes()
    summary = QuantizationSummary(f"{qc.method} ({qc.describe()})", layers, before, after)
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
