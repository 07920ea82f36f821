"""An eager step's metadata on the device: packed into two pinned host buffers and sent
with two asynchronous copies into persistent device buffers.

From pageable memory, `.to(device, non_blocking=True)` is a synchronous copy, and the
eager path used to make six of them per step (ids, positions, slots, block tables, lengths,
query starts). Here the int64 tensors go into one pinned buffer and the int32 ones into
another, each copied once; the device views are slices of buffers that live as long as
the runner, grown (doubled) when a step needs more.

Reuse is safe: a step ends with its sampled ids copied to the host (`tolist()`), which
waits for the stream, so the previous step's copies are done before the next step
rewrites the host buffers. On the CPU there is nothing to stage; the runner passes the
host tensors through."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StagedStep:
    input_ids: torch.Tensor  # [num_tokens] int64, on the device
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, width] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32


class StepStaging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pin = device.type == "cuda"
        self._host64, self._dev64 = self._pair(0, torch.int64)
        self._host32, self._dev32 = self._pair(0, torch.int32)

    def _pair(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty(n, dtype=dtype, pin_memory=self._pin),
                torch.empty(n, dtype=dtype, device=self.device))

    def upload(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64, host
        positions: torch.Tensor,  # [num_tokens] int64
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        block_tables: torch.Tensor,  # [num_seqs, width] int32
        seq_lens: list[int],
        query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    ) -> StagedStep:
        t, (s, w) = input_ids.shape[0], block_tables.shape
        n64, n32 = 3 * t, (s + 1) + s + s * w
        if self._host64.shape[0] < n64:
            self._host64, self._dev64 = self._pair(max(n64, 2 * self._host64.shape[0]), torch.int64)
        if self._host32.shape[0] < n32:
            self._host32, self._dev32 = self._pair(max(n32, 2 * self._host32.shape[0]), torch.int32)
        h64, h32 = self._host64, self._host32
        h64[:t], h64[t:2 * t], h64[2 * t:3 * t] = input_ids, positions, slot_mapping
        h32[:s + 1] = query_start_loc
        h32[s + 1:2 * s + 1] = torch.tensor(seq_lens, dtype=torch.int32)
        h32[2 * s + 1:n32] = block_tables.reshape(-1)
        self._dev64[:n64].copy_(h64[:n64], non_blocking=True)
        self._dev32[:n32].copy_(h32[:n32], non_blocking=True)
        d64, d32 = self._dev64, self._dev32
        return StagedStep(d64[:t], d64[t:2 * t], d64[2 * t:3 * t],
                          d32[2 * s + 1:n32].view(s, w), d32[s + 1:2 * s + 1], d32[:s + 1])
