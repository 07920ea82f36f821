"""A GPTQ checkpoint's `quantization_config` (AutoGPTQ, GPTQModel, optimum; vLLM's
`--quantization gptq`), read and checked once at start-up. The engine reads 4- and 8-bit
weights, group-wise or per output channel (group_size -1), symmetric or with zero points,
in the `gptq` (v1) and `gptq_v2` checkpoint formats, with or without act-order:

    quantization_config:
      quant_method: gptq
      bits: 4                  (4 or 8)
      group_size: 128          (-1: per channel; the last group may be shorter)
      desc_act: false          (true: act-order, the input rows permuted by g_idx)
      sym: true
      checkpoint_format: gptq  (v1: zero points stored minus one; gptq_v2: as they are)
      lm_head: false

Every decoder linear is quantized; the embedding and LM head stay float. The tensors'
layout is quant_checkpoint_load.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .checkpoint import WeightScheme, check_bits, is_decoder_linear

METHOD = "gptq"
FORMATS = ("gptq", "gptq_v2")
LEAVES = frozenset({"qweight", "qzeros", "scales"})
_TOP = "quantization_config"


@dataclass(frozen=True)
class GPTQConfig:
    scheme: WeightScheme
    v1_zeros: bool  # checkpoint_format gptq: zero points are stored minus one
    act_order: bool = False  # desc_act: every layer has a g_idx that permutes its groups
    method: str = METHOD
    whole_groups: bool = False  # ceil(in_features / group_size) groups
    float_hint: str = ""

    def scheme_for(self, name: str, module_class: str) -> WeightScheme | None:
        return self.scheme if module_class == "Linear" and is_decoder_linear(name) else None

    def leaves(self, scheme: WeightScheme) -> frozenset[str]:
        return LEAVES

    def describe(self) -> str:
        return (f"{self.scheme.describe()}, {'v1' if self.v1_zeros else 'v2'} zero points"
                + (", act-order" if self.act_order else ""))


def parse(quant: dict[str, Any]) -> GPTQConfig:
    """Check config.json's quantization_config; ValueError naming the field otherwise."""
    if quant.get("quant_method") != METHOD:
        raise ValueError(f"{_TOP}.quant_method={quant.get('quant_method')!r}: expected {METHOD!r}")
    bits = check_bits(f"{_TOP}.bits", quant.get("bits"))
    group = quant.get("group_size", 128)
    if isinstance(group, bool) or not isinstance(group, int) or (group <= 0 and group != -1):
        raise ValueError(f"{_TOP}.group_size={group!r}: must be a positive integer or -1 (per channel)")
    act_order = quant.get("desc_act", False)
    if not isinstance(act_order, bool):
        raise ValueError(f"{_TOP}.desc_act={act_order!r}: must be true or false")
    sym = quant.get("sym", True)
    if not isinstance(sym, bool):
        raise ValueError(f"{_TOP}.sym={sym!r}: must be true or false")
    fmt = quant.get("checkpoint_format", quant.get("format", "gptq"))
    if fmt not in FORMATS:
        raise ValueError(f"{_TOP}.checkpoint_format={fmt!r}: only {' and '.join(FORMATS)} are read "
                         f"(kernel-specific layouts such as marlin are not)")
    if quant.get("lm_head", False) is not False:
        raise ValueError(f"{_TOP}.lm_head={quant['lm_head']!r}: a quantized LM head is not read; only "
                         f"the decoder layers' linears can be quantized")
    pack = quant.get("pack_dtype", "int32")
    if pack not in ("int32", "torch.int32"):
        raise ValueError(f"{_TOP}.pack_dtype={pack!r}: only int32 words are read")
    for key in ("dynamic", "modules_in_block_to_quantize"):
        if quant.get(key):
            raise ValueError(f"{_TOP}.{key}: per-module overrides are not read; every decoder linear "
                             f"must share one scheme")
    scheme = WeightScheme(bits, None if group == -1 else group, sym, _TOP)
    return GPTQConfig(scheme=scheme, v1_zeros=fmt == "gptq", act_order=act_order)
