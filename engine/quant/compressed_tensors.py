"""A compressed-tensors checkpoint's `quantization_config` (the format vLLM's llm-compressor
writes), read and checked once at start-up. The engine reads weight-only integer schemes
stored `pack-quantized`: W4A16 and W8A16, per output channel or group-wise, symmetric or
with zero points. Anything else is refused with the field that asks for it.

    quantization_config:
      quant_method: compressed-tensors
      format: pack-quantized             (or per group; mixed-precision if all groups pack)
      config_groups:
        group_0:
          targets: [Linear]              ("Linear", a module name, or "re:<regex>")
          weights: {num_bits: 4, type: int, strategy: group, group_size: 128, symmetric: true}
          input_activations: null        (quantized activations: not W*A16, refused)
      ignore: [lm_head]

Which checkpoint module is quantized, and how: the first group whose targets match its
name (or its class, Linear or Embedding), unless an `ignore` entry matches, as in
compressed_tensors.utils.match. The tensors' layout is quant_compressed_tensors_load.py's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .checkpoint import WeightScheme, check_bits, per_word

METHOD = "compressed-tensors"
FORMAT = "pack-quantized"
MIXED = "mixed-precision"  # the top-level format when groups name their own
# compressed_tensors' preset schemes a group may be written as ({"W4A16": ["Linear"]}).
PRESETS = {"W4A16": (4, 128, True), "W4A16_ASYM": (4, 128, False), "W8A16": (8, 128, True)}
LEAVES = frozenset({"weight_packed", "weight_scale", "weight_shape"})


@dataclass(frozen=True)
class CompressedTensorsConfig:
    groups: tuple[tuple[str, tuple[str, ...], WeightScheme], ...]  # (group name, targets, scheme)
    ignore: tuple[str, ...]
    method: str = METHOD
    whole_groups: bool = True  # weight_scale holds in_features // group_size groups
    float_hint: str = " (add it to quantization_config.ignore)"

    def scheme_for(self, name: str, module_class: str) -> WeightScheme | None:
        """The scheme of the checkpoint module `name` (module_class: Linear or Embedding)."""
        if any(_matches(name, module_class, t) for t in self.ignore):
            return None
        return next((scheme for _, targets, scheme in self.groups
                     if any(_matches(name, module_class, t) for t in targets)), None)

    def leaves(self, scheme: WeightScheme) -> frozenset[str]:
        return LEAVES if scheme.symmetric else LEAVES | {"weight_zero_point"}

    def describe(self) -> str:
        return ", ".join(sorted({scheme.describe() for _, _, scheme in self.groups}))


def _matches(name: str, module_class: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target in (name, module_class)


def is_compressed_tensors(raw: dict[str, Any]) -> bool:
    quant = raw.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == METHOD


def _empty(value: Any) -> bool:
    return value is None or value == {} or value == []


def parse(quant: dict[str, Any]) -> CompressedTensorsConfig:
    """Check config.json's quantization_config; ValueError naming the field otherwise."""
    top = "quantization_config"
    if quant.get("quant_method") != METHOD:
        raise ValueError(f"{top}.quant_method={quant.get('quant_method')!r}: only {METHOD!r} "
                         f"checkpoints are read")
    fmt = quant.get("format")
    if fmt not in (FORMAT, MIXED, None):
        raise ValueError(f"{top}.format={fmt!r}: only {FORMAT!r} (integer weights packed into "
                         f"int32) is read")
    for key, what in (("kv_cache_scheme", "a quantized KV cache"),
                      ("sparsity_config", "sparse weights"),
                      ("transform_config", "rotated weights (transforms)"),
                      ("moe_sparsity_config", "expert sparsity")):
        if not _empty(quant.get(key)):
            raise ValueError(f"{top}.{key}: {what} is not implemented")
    ignore = quant.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise ValueError(f"{top}.ignore={ignore!r}: must be a list of module names or 're:' patterns")
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{top}.config_groups={groups!r}: must name at least one group")
    parsed = tuple(_group(f"{top}.config_groups.{name}", name, group, fmt) for name, group in groups.items())
    return CompressedTensorsConfig(groups=parsed, ignore=tuple(ignore))


def _group(field: str, name: str, group: Any, fmt: str | None) -> tuple[str, tuple[str, ...], WeightScheme]:
    if isinstance(group, list):  # a preset scheme's name mapped to its targets
        if name not in PRESETS:
            raise ValueError(f"{field}: preset scheme {name!r} is not supported (only "
                             f"{', '.join(PRESETS)})")
        bits, size, symmetric = PRESETS[name]
        return name, _targets(field, group), WeightScheme(bits, size, symmetric, field)
    if not isinstance(group, dict):
        raise ValueError(f"{field}={group!r}: must be a quantization scheme")
    unknown = set(group) - {"targets", "weights", "input_activations", "output_activations", "format"}
    if unknown:
        raise ValueError(f"{field}: unknown keys {sorted(unknown)}")
    group_fmt = group.get("format") or fmt
    if group_fmt != FORMAT:
        raise ValueError(f"{field}.format={group_fmt!r}: only {FORMAT!r} (integer weights packed "
                         f"into int32) is read")
    for key in ("input_activations", "output_activations"):
        if group.get(key) is not None:
            raise ValueError(f"{field}.{key}: quantized activations are not implemented; only "
                             f"weight-only schemes (W4A16, W8A16) are read")
    return name, _targets(f"{field}.targets", group.get("targets")), _weights(f"{field}.weights",
                                                                              group.get("weights"))


def _targets(field: str, targets: Any) -> tuple[str, ...]:
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"{field}={targets!r}: must be a non-empty list of module names, classes "
                         f"or 're:' patterns")
    return tuple(targets)


def _weights(field: str, w: Any) -> WeightScheme:
    if not isinstance(w, dict):
        raise ValueError(f"{field}={w!r}: the group must quantize weights")
    bits = check_bits(f"{field}.num_bits", w.get("num_bits", 8))
    kind = str(w.get("type", "int")).lower()
    if kind != "int":
        raise ValueError(f"{field}.type={w.get('type')!r}: only integer weights are read")
    group_size = w.get("group_size")
    strategy = w.get("strategy")
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)):
        raise ValueError(f"{field}.group_size={group_size!r}: must be an integer")
    if strategy is None:  # inferred from group_size, as compressed_tensors' QuantizationArgs does
        strategy = "tensor" if group_size is None else "group" if group_size > 0 else "channel"
    strategy = str(strategy).lower()
    if strategy == "group":
        if group_size is None or group_size <= 0:
            raise ValueError(f"{field}.group_size={group_size!r}: strategy 'group' needs a positive "
                             f"integer")
        if group_size % per_word(bits):
            raise ValueError(f"{field}.group_size={group_size}: must be a multiple of "
                             f"{per_word(bits)} for {bits}-bit weights")
    elif strategy == "channel":
        if group_size not in (None, -1):
            raise ValueError(f"{field}.group_size={group_size!r}: strategy 'channel' takes none")
        group_size = None
    else:
        raise ValueError(f"{field}.strategy={strategy!r}: only 'channel' and 'group' are read")
    if w.get("dynamic", False) is not False:
        raise ValueError(f"{field}.dynamic={w.get('dynamic')!r}: weights must be static (false)")
    actorder = w.get("actorder")
    if actorder not in (None, False, "weight", "static"):
        # 'group' stores a permutation (weight_g_idx) the engine's layout has no room for.
        raise ValueError(f"{field}.actorder={actorder!r}: only None or 'weight' (no g_idx) is read")
    for key in ("block_structure", "scale_dtype"):
        if w.get(key) is not None:
            raise ValueError(f"{field}.{key}={w[key]!r}: is not implemented")
    symmetric = w.get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise ValueError(f"{field}.symmetric={symmetric!r}: must be true or false")
    return WeightScheme(bits, group_size, symmetric, field)
