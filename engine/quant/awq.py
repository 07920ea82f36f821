"""An AWQ checkpoint's `quantization_config` (AutoAWQ, GPTQModel, llm-awq via transformers;
vLLM's `--quantization awq`), read and checked once at start-up. The engine reads the GEMM
layout: 4-bit weights, group-wise, with zero points or symmetric (qzeros stored either way):

    quantization_config:
      quant_method: awq
      bits: 4                  (AutoAWQ also writes w_bit)
      group_size: 128          (q_group_size); must divide in_features
      zero_point: true         (false: symmetric, GPTQModel's default)
      version: gemm            (GPTQModel writes format: gemm)
      modules_to_not_convert: [...]   (kept float)

Every other decoder linear is quantized; the embedding and LM head stay float. The tensors'
layout is quant_checkpoint_load.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .checkpoint import WeightScheme, is_decoder_linear

METHOD = "awq"
LEAVES = frozenset({"qweight", "qzeros", "scales"})
_TOP = "quantization_config"


@dataclass(frozen=True)
class AWQConfig:
    scheme: WeightScheme
    not_converted: tuple[str, ...]  # module names (or parts of them) kept float
    method: str = METHOD
    whole_groups: bool = True  # AWQ's scales hold in_features // group_size groups
    float_hint: str = " (name it in quantization_config.modules_to_not_convert)"

    def scheme_for(self, name: str, module_class: str) -> WeightScheme | None:
        if module_class != "Linear" or any(m in name for m in self.not_converted):
            return None
        return self.scheme if is_decoder_linear(name) else None

    def leaves(self, scheme: WeightScheme) -> frozenset[str]:
        return LEAVES

    def describe(self) -> str:
        return f"{self.scheme.describe()}, GEMM layout"


def parse(quant: dict[str, Any]) -> AWQConfig:
    """Check config.json's quantization_config; ValueError naming the field otherwise."""
    if quant.get("quant_method") != METHOD:
        raise ValueError(f"{_TOP}.quant_method={quant.get('quant_method')!r}: expected {METHOD!r}")
    key = "bits" if "bits" in quant else "w_bit"
    bits = quant.get(key, 4)
    if bits != 4 or isinstance(bits, bool):
        raise ValueError(f"{_TOP}.{key}={bits!r}: only 4-bit AWQ checkpoints are read")
    gkey = "group_size" if "group_size" in quant else "q_group_size"
    group = quant.get(gkey, 128)
    if isinstance(group, bool) or not isinstance(group, int) or group <= 0 or group % 8:
        raise ValueError(f"{_TOP}.{gkey}={group!r}: must be a positive multiple of 8")
    zero_point = quant.get("zero_point", True)
    if not isinstance(zero_point, bool):
        raise ValueError(f"{_TOP}.zero_point={zero_point!r}: must be true or false")
    vkey = "version" if "version" in quant else "format"
    version = str(quant.get(vkey, "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"{_TOP}.{vkey}={quant.get(vkey)!r}: only the GEMM layout is read (GEMV, "
                         f"Marlin and exllama layouts are not)")
    skip = quant.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
        raise ValueError(f"{_TOP}.modules_to_not_convert={skip!r}: must be a list of module names")
    # Without zero points (symmetric) the checkpoint still stores qzeros, all 8.
    return AWQConfig(scheme=WeightScheme(4, group, not zero_point, _TOP), not_converted=tuple(skip))
