"""What a quantized checkpoint's config.json says about its decoder linears, whatever the
format (compressed-tensors, GPTQ, AWQ): which module gets which integer scheme, checked
against the engine's one layout (quant_pack.py) at start-up, before any weight is read.
Read without torch: the simulator reads config.json too.

Each format's module (quant_compressed_tensors.py, quant_gptq.py, quant_awq.py) parses its
`quantization_config` into an object with this shape (CheckpointQuantization); its tensors
are converted by quant_checkpoint_load.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

# quant_pack's BITS and words; not imported from it (torch).
BITS = (4, 8)


def per_word(bits: int) -> int:
    return 32 // bits


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# Each decoder layer's linears as the checkpoint names them.
DECODER_SOURCES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def is_decoder_linear(name: str) -> bool:
    """A checkpoint module name of one of DECODER_SOURCES (model.layers.<i>.<path>)."""
    return name.startswith("model.layers.") and name.split(".", 3)[-1] in DECODER_SOURCES


@dataclass(frozen=True)
class WeightScheme:
    bits: int
    group_size: int | None  # None: one group per output channel
    symmetric: bool
    field: str  # where in quantization_config it was set, for messages

    def group_for(self, in_features: int) -> int:
        return self.group_size or in_features

    def describe(self) -> str:
        grouping = "per-channel" if self.group_size is None else f"group {self.group_size}"
        return f"W{self.bits}A16 {grouping} {'symmetric' if self.symmetric else 'with zero points'}"


class CheckpointQuantization(Protocol):
    method: str  # quantization_config.quant_method, vLLM's --quantization name
    # A group must divide in_features (the format stores in_features // group_size groups);
    # False: the last group may be shorter (ceil).
    whole_groups: bool
    float_hint: str  # how to keep a module float in this format, for messages

    def scheme_for(self, name: str, module_class: str) -> WeightScheme | None:
        """The scheme of checkpoint module `name` (module_class: Linear or Embedding); None: float."""

    def leaves(self, scheme: WeightScheme) -> frozenset[str]:
        """The tensors (leaf names) a module quantized with `scheme` has, besides its bias."""

    def describe(self) -> str: ...


def quantization_config(raw: dict[str, Any]) -> dict[str, Any] | None:
    quant = raw.get("quantization_config")
    return quant if isinstance(quant, dict) else None


def quant_method(raw: dict[str, Any]) -> str:
    quant = quantization_config(raw)
    return str(quant.get("quant_method", "?")) if quant else "?"


def check_bits(field: str, bits: Any) -> int:
    if bits not in BITS or isinstance(bits, bool):
        raise ValueError(f"{field}={bits!r}: only {' and '.join(map(str, BITS))}-bit weights are read")
    return bits


def decoder_in_features(cfg) -> dict[str, int]:
    """in_features of each DECODER_SOURCES path, from a ModelConfig."""
    hidden, attn = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    return {"self_attn.q_proj": hidden, "self_attn.k_proj": hidden, "self_attn.v_proj": hidden,
            "self_attn.o_proj": attn, "mlp.gate_proj": hidden, "mlp.up_proj": hidden,
            "mlp.down_proj": cfg.intermediate_size}


def decoder_plan(qc: CheckpointQuantization, layers: int, in_features: dict[str, int]
                 ) -> dict[str, WeightScheme | None]:
    """Each decoder linear's scheme by checkpoint module name (None: stays float), checked
    against the engine's layout: fused parts (q/k/v, gate/up) quantized alike, in_features
    that pack into words (and that groups divide, where the format needs it;
    `in_features`: by DECODER_SOURCES path). The embedding and the LM head must stay float."""
    for name, cls in (("lm_head", "Linear"), ("model.embed_tokens", "Embedding")):
        scheme = qc.scheme_for(name, cls)
        if scheme is not None:
            raise ValueError(f"{scheme.field} quantizes {name}, but only the decoder layers' linears "
                             f"can be quantized{qc.float_hint}")
    plan: dict[str, WeightScheme | None] = {}
    for i in range(layers):
        for path in DECODER_SOURCES:
            name = f"model.layers.{i}.{path}"
            scheme = plan[name] = qc.scheme_for(name, "Linear")
            k = in_features[path]
            if scheme is None:
                continue
            if qc.whole_groups and scheme.group_size is not None and k % scheme.group_size:
                raise ValueError(f"{scheme.field}.group_size={scheme.group_size}: does not divide "
                                 f"{name}'s in_features {k}")
            if k % per_word(scheme.bits):
                raise ValueError(f"{name}: in_features {k} is not a multiple of {per_word(scheme.bits)} "
                                 f"({scheme.bits}-bit weights pack {per_word(scheme.bits)} to a word)")
        for parent, fused, parts in (("self_attn", "qkv_proj", FUSED["qkv_proj"]),
                                     ("mlp", "gate_up_proj", FUSED["gate_up_proj"])):
            schemes = [plan[f"model.layers.{i}.{parent}.{p}"] for p in parts]
            k = in_features[f"{parent}.{parts[0]}"]
            shapes = {None if s is None else (s.bits, s.group_for(k)) for s in schemes}
            if len(shapes) > 1:
                how = ", ".join(s.describe() if s else "float" for s in schemes)
                raise ValueError(f"quantization_config: model.layers.{i}.{parent}.{{{','.join(parts)}}} "
                                 f"are quantized differently ({how}); the engine runs them as one "
                                 f"{fused} and needs one bit width and group size")
    return plan
