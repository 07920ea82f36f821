"""What one step's attention needs to know about the flattened batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cpu import TorchAttentionPlan


@dataclass
class AttentionMetadata:
    """Describes a flattened step: requests' new tokens laid end to end.

    Request i owns query rows query_start_loc[i]:query_start_loc[i+1]; those rows are
    its *last* (query_len) tokens of seq_lens[i] in total, so the first
    seq_lens[i] - query_len tokens are already in the paged cache (a prefix-cache hit
    or an earlier chunk). Query row j of request i sits at position
    seq_lens[i] - query_len + j and attends causally to positions <= its own.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32: cached + new tokens after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    max_query_len: int
    max_seq_len: int
    # Host-side copies, so backends that loop per request need no device sync.
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]
    # The torch backend's per-step plan (cpu_attention.py), built once for all layers.
    torch_plan: TorchAttentionPlan | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
