"""A step's model inputs from the scheduler's output: token ids, positions, the block
tables and the slot mapping, built with tensor ops on the host.

Block tables live in one persistent host tensor, a row per request while it holds blocks;
each step writes only the block ids allocated since the last (O(new blocks)), and frees
the rows of requests whose blocks were freed (`SchedulerOutput.freed`: preempted, finished
or aborted)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..core.request import Request
from ..core.scheduler import SchedulerOutput


class BlockTables:
    def __init__(self, rows: int = 64, blocks_per_row: int = 64) -> None:
        self.table = torch.zeros((rows, blocks_per_row), dtype=torch.int32)  # [rows, max_blocks]
        self._free_rows = list(range(rows - 1, -1, -1))

    def release(self, requests: list[Request]) -> None:
        for req in requests:
            row = req.row
            if row.table_row is not None:
                self._free_rows.append(row.table_row)
                row.table_row = None  # sync() starts the next row from block 0

    def sync(self, req: Request) -> int:
        """Write the request's blocks allocated since the last sync; return its row."""
        row, kv = req.row, req.kv
        if row.table_row is None:
            if not self._free_rows:
                self._grow(rows=2 * self.table.shape[0])
            row.table_row, row.num_table_blocks, row.kv_version = self._free_rows.pop(), 0, kv.version
        ids, done = kv.block_ids, row.num_table_blocks
        if row.kv_version != kv.version:  # ids left the table (a trim): rewrite past those kept
            done = min(done, kv.kept) if kv.version == row.kv_version + 1 else 0
            row.num_table_blocks, row.kv_version = done, kv.version
        if len(ids) > done:
            if len(ids) > self.table.shape[1]:
                self._grow(cols=max(2 * self.table.shape[1], len(ids)))
            self.table[row.table_row, done:len(ids)] = torch.tensor(ids[done:], dtype=torch.int32)
            row.num_table_blocks = len(ids)
        return row.table_row

    def _grow(self, rows: int | None = None, cols: int | None = None) -> None:
        # max_num_seqs and max_model_len can be raised while serving.
        old_rows, old_cols = self.table.shape
        rows, cols = rows or old_rows, cols or old_cols
        grown = torch.zeros((rows, cols), dtype=torch.int32)
        grown[:old_rows, :old_cols] = self.table
        self.table = grown
        self._free_rows = list(range(rows - 1, old_rows - 1, -1)) + self._free_rows


@dataclass
class StepInputs:
    """Host tensors for one step, in scheduled order."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32 (rows padded with stale ids)
    seq_lens: list[int]  # cached + new tokens after this step
    query_lens: list[int]
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    sample_rows: list[int]  # the token row whose logits each sampling request samples from
    sample_requests: list[Request]
    # Per sampling request, the drafts whose rows follow its sample row (speculation);
    # empty when no request in the step has any.
    spec_drafts: list[list[int]]

    def logit_rows(self) -> list[int]:
        """The token rows whose logits the step samples from: each sampling request's last
        row, and with speculation one more per draft (in scheduled order)."""
        if not self.spec_drafts:
            return self.sample_rows
        return [row + j for row, drafts in zip(self.sample_rows, self.spec_drafts)
                for j in range(len(drafts) + 1)]

    def for_ranks(self) -> StepInputs:
        """What other ranks need of the step (sent to them each step): no Request objects."""
        return dataclasses.replace(self, sample_requests=[])

    def split(self, parts: int) -> list[StepInputs]:
        """The step as up to `parts` micro-batches of whole sequences (pipeline parallelism),
        in order: their logit rows, concatenated, are the step's."""
        n = len(self.seq_lens)
        parts = max(1, min(parts, n))
        bounds = [round(i * n / parts) for i in range(parts + 1)]
        qsl = self.query_start_loc.tolist()
        out = []
        for a, b in zip(bounds, bounds[1:]):
            t0, t1 = qsl[a], qsl[b]
            keep = [i for i, row in enumerate(self.sample_rows) if t0 <= row < t1]
            drafts = [self.spec_drafts[i] for i in keep] if self.spec_drafts else []
            out.append(StepInputs(
                self.input_ids[t0:t1], self.positions[t0:t1], self.slot_mapping[t0:t1],
                self.block_tables[a:b], self.seq_lens[a:b], self.query_lens[a:b],
                self.query_start_loc[a:b + 1] - t0, [self.sample_rows[i] - t0 for i in keep],
                [self.sample_requests[i] for i in keep] if self.sample_requests else [],
                drafts if any(drafts) else []))
        return out

    @classmethod
    def profile(cls, num_tokens: int, block_size: int) -> StepInputs:
        """One prompt of `num_tokens` tokens over blocks 0.., its last row sampled (the
        memory profile's forward)."""
        tables = torch.arange(-(-num_tokens // block_size), dtype=torch.int32)[None, :]  # [1, num_blocks]
        return cls(torch.zeros(num_tokens, dtype=torch.long), torch.arange(num_tokens), torch.arange(num_tokens),
                   tables, [num_tokens], [num_tokens], torch.tensor([0, num_tokens], dtype=torch.int32),
                   [num_tokens - 1], [], [])

    @classmethod
    def build(cls, out: SchedulerOutput, tables: BlockTables, block_size: int) -> StepInputs:
        tables.release(out.freed)
        ids: list[int] = []
        starts, query_lens, rows = [], [], []
        sample_rows, sample_requests, spec_drafts = [], [], []
        for item in out.scheduled:
            req = item.request
            start = req.num_computed_tokens
            drafts = item.spec_token_ids
            ids += req.token_at(start, start + item.num_new_tokens - len(drafts))
            starts.append(start)
            query_lens.append(item.num_new_tokens)
            rows.append(tables.sync(req))
            if item.samples:
                sample_rows.append(len(ids) - 1)
                sample_requests.append(req)
                spec_drafts.append(drafts)
            if drafts:
                ids += drafts
        return cls._assemble(ids, starts, query_lens, rows, tables, block_size, sample_rows, sample_requests,
                             spec_drafts if any(spec_drafts) else [])

    @classmethod
    def for_rows(cls, rows: list[tuple[Request, int, list[int]]], tables: BlockTables,
                 block_size: int) -> StepInputs:
        """Inputs for (request, first position, tokens) rows, each sampling its last token:
        a draft model's passes, which feed what the scheduler did not schedule, through
        the same block tables (the draft's cache has the target's block layout)."""
        ids: list[int] = []
        starts, query_lens, table_rows, sample_rows = [], [], [], []
        for req, start, tokens in rows:
            ids += tokens
            starts.append(start)
            query_lens.append(len(tokens))
            table_rows.append(tables.sync(req))
            sample_rows.append(len(ids) - 1)
        return cls._assemble(ids, starts, query_lens, table_rows, tables, block_size, sample_rows,
                             [req for req, _, _ in rows], [])

    @classmethod
    def _assemble(cls, ids: list[int], starts: list[int], query_lens: list[int], rows: list[int],
                  tables: BlockTables, block_size: int, sample_rows: list[int], sample_requests: list[Request],
                  spec_drafts: list[list[int]]) -> StepInputs:
        seq_lens = [s + n for s, n in zip(starts, query_lens)]
        q = torch.tensor(query_lens)  # [num_seqs]
        ends = torch.cumsum(q, 0)  # [num_seqs]
        first_row = ends - q  # [num_seqs] each request's first token row
        owner = torch.repeat_interleave(torch.arange(len(q)), q)  # [num_tokens] its request
        # A request's rows hold positions start .. start + query_len - 1.
        positions = torch.arange(len(ids)) - (first_row - torch.tensor(starts))[owner]
        width = -(-max(seq_lens) // block_size)
        block_tables = tables.table[torch.tensor(rows), :width]  # [num_seqs, width] (a copy)
        blocks = block_tables[owner, positions // block_size].long()  # [num_tokens]
        return cls(torch.tensor(ids), positions, blocks * block_size + positions % block_size,
                   block_tables, seq_lens, query_lens,
                   torch.cat([ends.new_zeros(1), ends]).to(torch.int32), sample_rows, sample_requests,
                   spec_drafts)
