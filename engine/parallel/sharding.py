"""Which part of the model one rank holds: its tensor-parallel slice of every layer and
its pipeline stage's layers, and which slice of each checkpoint tensor that is.

Megatron-style splits (Shoeybi et al. 2019): q/k/v and gate/up by output rows (column
parallel: each rank computes whole heads / a slice of the MLP's inner width), o and down by
input columns (row parallel: partial sums, one all-reduce each), the embedding and LM head
by vocabulary rows. The KV cache follows the KV heads. Norms are replicated."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..config.model import ModelConfig

LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
# checkpoint projection -> the dimension its tensor-parallel slice is cut along
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class ModelShard:
    """One rank's part: tensor slice `tp_rank` of `tp_size`, layers [first_layer, end_layer)."""

    tp_size: int = 1
    tp_rank: int = 0
    first_layer: int = 0
    end_layer: int | None = None  # None: through the last
    has_embedding: bool = True  # the first pipeline stage
    has_head: bool = True  # the last pipeline stage: final norm and LM head

    @classmethod
    def plan(cls, cfg: ModelConfig, tp_size: int, tp_rank: int, pp_size: int, stage: int) -> ModelShard:
        check_divisible(cfg, tp_size, pp_size)
        first, end = stage_layers(cfg.num_hidden_layers, pp_size, stage)
        return cls(tp_size, tp_rank, first, end, stage == 0, stage == pp_size - 1)

    def num_layers(self, cfg: ModelConfig) -> int:
        end = cfg.num_hidden_layers if self.end_layer is None else self.end_layer
        return end - self.first_layer

    def holds_layer(self, index: int, cfg: ModelConfig) -> bool:
        return self.first_layer <= index < self.first_layer + self.num_layers(cfg)

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """(first row, rows) of the padded vocabulary this rank holds; rows the same on every
        rank (ceil(vocab / tp)), the last rank's tail past the vocabulary zero."""
        per_rank = -(-vocab_size // self.tp_size)
        return self.tp_rank * per_rank, per_rank

    def slice_of(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """(dimension, start, length) of a checkpoint tensor this rank reads; None: all of it.
        The vocabulary's last slice may run past the tensor: the reader pads it with zeros."""
        if self.tp_size == 1:
            return None
        if name in VOCAB_PARALLEL:
            start, rows = self.vocab_rows(shape[0])
            return 0, start, rows
        match = LAYER.match(name)
        if match is None:
            return None
        proj = match.group(2).split(".")[-2]
        if proj in COLUMN_PARALLEL:
            dim = 0  # weight [out, in] and bias [out]
        elif proj in ROW_PARALLEL:
            if match.group(2).endswith(".bias"):
                return None  # added once, after the all-reduce: no Llama/Qwen2 o/down has one
            dim = 1
        else:
            return None
        per_rank = shape[dim] // self.tp_size
        return dim, self.tp_rank * per_rank, per_rank

    def local_name(self, name: str, cfg: ModelConfig) -> str | None:
        """The rank's parameter name for a checkpoint tensor, or None when it lives on
        another pipeline stage (and is not read at all)."""
        match = LAYER.match(name)
        if match is not None:
            index = int(match.group(1))
            if not self.holds_layer(index, cfg):
                return None
            return f"model.layers.{index - self.first_layer}.{match.group(2)}"
        if name == "model.embed_tokens.weight":
            if self.has_embedding:
                return name
            # A tied LM head on a later stage is the embedding's tensor.
            return "lm_head.weight" if self.has_head and cfg.tie_word_embeddings else None
        if name in ("lm_head.weight", "model.norm.weight"):
            return name if self.has_head else None
        return name


def stage_layers(num_layers: int, pp_size: int, stage: int) -> tuple[int, int]:
    """[first, end) of a stage's decoder layers: as even as it divides, earlier stages one
    more (the first also embeds and the last also runs the LM head, which weigh little
    next to a layer in a large model)."""
    base, extra = divmod(num_layers, pp_size)
    first = stage * base + min(stage, extra)
    return first, first + base + (1 if stage < extra else 0)


def check_divisible(cfg: ModelConfig, tp_size: int, pp_size: int) -> None:
    """Refuse a split the sharded model cannot compute, naming the field. A KV-head count
    that tp does not divide is refused (vLLM replicates KV heads then; kvpilot does not)."""
    for field, value in (("num_attention_heads", cfg.num_attention_heads),
                         ("num_key_value_heads", cfg.num_key_value_heads),
                         ("intermediate_size", cfg.intermediate_size)):
        if value % tp_size:
            raise ValueError(f"tensor_parallel_size {tp_size} does not divide the model's {field} "
                             f"({value}); choose a tensor_parallel_size that does")
    if pp_size > cfg.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size {pp_size} is more than the model's "
                         f"num_hidden_layers ({cfg.num_hidden_layers})")
