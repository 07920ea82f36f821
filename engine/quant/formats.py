"""The quantized checkpoint formats the engine reads, by `quantization_config.quant_method`
(vLLM's `--quantization` names)."""

from __future__ import annotations

from typing import Any, Callable

from . import awq as quant_awq, compressed_tensors as quant_compressed_tensors, gptq as quant_gptq
from .checkpoint import CheckpointQuantization, quantization_config

PARSERS: dict[str, Callable[[dict[str, Any]], CheckpointQuantization]] = {
    quant_compressed_tensors.METHOD: quant_compressed_tensors.parse,
    quant_gptq.METHOD: quant_gptq.parse,
    quant_awq.METHOD: quant_awq.parse,
}
READ = "compressed-tensors (pack-quantized W4A16/W8A16), GPTQ (4/8-bit) and AWQ (4-bit GEMM)"


def is_readable(raw: dict[str, Any]) -> bool:
    """config.json names a quantized checkpoint format the engine reads."""
    quant = quantization_config(raw)
    return quant is not None and quant.get("quant_method") in PARSERS


def parse_checkpoint(raw: dict[str, Any]) -> CheckpointQuantization | None:
    """config.json's quantization_config, checked (None: float weights); ValueError naming
    the field for a format or setting the engine does not read."""
    quant = quantization_config(raw)
    if quant is None:
        return None
    return PARSERS[quant.get("quant_method")](quant)
