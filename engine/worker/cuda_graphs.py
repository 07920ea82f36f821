"""Decode steps on CUDA replayed from CUDA graphs, one graph per batch-size bucket.

An eager decode step launches every kernel of every layer from Python; at small batches
the launches, not the GPU, set the step time. At start-up each bucket's forward pass is
captured once over persistent device buffers (token ids, positions, slots, block tables,
lengths); a decode step copies its rows into those buffers through pinned host staging,
pads the batch to its bucket, and replays. Prefill and mixed steps, batches above the
largest bucket and contexts wider than the captured block table run eagerly, as does
everything with `enforce_eager` (vLLM's name) or off CUDA.

Pad rows write their K/V into a scratch block that the block pool never hands out and
attend to that one slot, so they touch no request's cache.

The bucket ladder, the choice of bucket, the staging and padding are plain host code,
tested on the CPU (a bucket that was not captured runs the same forward eagerly over the
same buffers); capture and replay need a GPU (kernels/gpu_check.py measures them)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ..attention.metadata import AttentionMetadata

log = logging.getLogger("kvpilot.engine")
MAX_CAPTURE_SIZE = 256  # vLLM's default largest captured batch


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """vLLM's ladder: 1, 2, 4, then every multiple of 8, up to min(max_num_seqs, limit);
    that top size itself is always a bucket."""
    top = min(max_num_seqs, limit)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured batch that holds `num_seqs` rows; None: run eagerly."""
    return next((s for s in sizes if s >= num_seqs), None)


@dataclass
class DecodeRows:
    """One decode step's inputs on the host, one row per sequence."""

    input_ids: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n] int64
    slot_mapping: torch.Tensor  # [n] int64
    block_tables: torch.Tensor  # [n, width] int32
    seq_lens: torch.Tensor  # [n] int32


class DecodeBuffers:
    """Same-shaped pinned host staging and persistent device buffers for `size` rows."""

    def __init__(self, size: int, table_width: int, device: torch.device) -> None:
        pin = device.type == "cuda"

        def pair(shape, dtype):
            return (torch.zeros(shape, dtype=dtype, pin_memory=pin),
                    torch.zeros(shape, dtype=dtype, device=device))

        self.size, self.table_width = size, table_width
        self.host_ids, self.ids = pair((size,), torch.int64)
        self.host_positions, self.positions = pair((size,), torch.int64)
        self.host_slots, self.slots = pair((size,), torch.int64)
        self.host_tables, self.tables = pair((size, table_width), torch.int32)
        self.host_seq_lens, self.seq_lens = pair((size,), torch.int32)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)

    def stage(self, rows: DecodeRows, bucket: int, scratch_block: int, block_size: int) -> None:
        """Copy `rows` into the first rows and pad up to `bucket`: pad rows write to and
        read one slot of the scratch block. Host writes, then one async copy per buffer."""
        n, width = rows.input_ids.shape[0], rows.block_tables.shape[1]
        if n > bucket or bucket > self.size or width > self.table_width:
            raise ValueError(f"{n} rows of {width} blocks do not fit bucket {bucket} "
                             f"({self.size} rows of {self.table_width} blocks)")
        self.host_ids[:n] = rows.input_ids
        self.host_ids[n:bucket] = 0
        self.host_positions[:n] = rows.positions
        self.host_positions[n:bucket] = 0
        self.host_slots[:n] = rows.slot_mapping
        self.host_slots[n:bucket] = scratch_block * block_size
        self.host_tables[:n, :width] = rows.block_tables
        self.host_tables[n:bucket, 0] = scratch_block
        self.host_seq_lens[:n] = rows.seq_lens
        self.host_seq_lens[n:bucket] = 1
        for host, dev in ((self.host_ids, self.ids), (self.host_positions, self.positions),
                          (self.host_slots, self.slots), (self.host_seq_lens, self.seq_lens)):
            dev[:bucket].copy_(host[:bucket], non_blocking=True)
        # A table row's columns past the row's own blocks are never read (seq_lens bound them).
        self.tables[:bucket].copy_(self.host_tables[:bucket], non_blocking=True)

    def metadata(self, bucket: int, max_seq_len: int) -> AttentionMetadata:
        """The first `bucket` rows as a decode step's metadata (device views, fixed addresses)."""
        return AttentionMetadata(
            slot_mapping=self.slots[:bucket], block_tables=self.tables[:bucket],
            seq_lens=self.seq_lens[:bucket], query_start_loc=self.query_start_loc[:bucket + 1],
            max_query_len=1, max_seq_len=max_seq_len,
            seq_lens_cpu=[1] * bucket, query_lens_cpu=[1] * bucket)


class DecodeGraphs:
    """Captured decode forwards over shared buffers; `run` replays the smallest fitting one."""

    def __init__(self, model, kv_caches, sizes: list[int], max_seq_len: int, block_size: int,
                 scratch_block: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.sizes, self.max_seq_len = sizes, max_seq_len
        self.block_size, self.scratch_block = block_size, scratch_block
        width = -(-max_seq_len // block_size)
        self.buffers = DecodeBuffers(sizes[-1], width, device)
        self.hidden = torch.zeros((sizes[-1], hidden_size), dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self._model, self._kv_caches = model, kv_caches

    def capture(self) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its memory pool."""
        start, before = time.perf_counter(), torch.cuda.memory_allocated()
        pool = torch.cuda.graph_pool_handle()
        empty = DecodeRows(*(torch.zeros(0, dtype=t) for t in (torch.int64,) * 3),
                           torch.zeros((0, 1), dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
        for bucket in reversed(self.sizes):
            self.buffers.stage(empty, bucket, self.scratch_block, self.block_size)
            self._forward(bucket)  # warm-up: Triton compiles outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(bucket)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = torch.cuda.memory_allocated() - before
        log.info("captured %d CUDA graphs (decode batches %d..%d, contexts up to %d tokens) in "
                 "%.1f s, %.0f MiB", len(self.graphs), self.sizes[0], self.sizes[-1],
                 self.max_seq_len, self.capture_seconds, self.capture_bytes / 2**20)

    def _forward(self, bucket: int) -> None:
        b = self.buffers
        self.hidden[:bucket] = self._model(b.ids[:bucket], b.positions[:bucket], self._kv_caches,
                                           b.metadata(bucket, self.max_seq_len))

    def fits(self, num_seqs: int, table_width: int) -> bool:
        return bucket_for(num_seqs, self.sizes) is not None and table_width <= self.buffers.table_width

    def run(self, rows: DecodeRows) -> torch.Tensor:  # [n, hidden]
        n = rows.input_ids.shape[0]
        bucket = bucket_for(n, self.sizes)
        if bucket is None:
            raise ValueError(f"no captured graph holds {n} rows (largest {self.sizes[-1]})")
        self.buffers.stage(rows, bucket, self.scratch_block, self.block_size)
        graph = self.graphs.get(bucket)
        if graph is None:  # not captured (off CUDA: the tests run this path eagerly)
            self._forward(bucket)
        else:
            graph.replay()
        return self.hidden[:n]
