"""Property tests of the KV cache manager and scheduler: no leaks, no double frees,
no negative reference counts, and prefix hits only ever return matching tokens, with and
without speculative steps (drafts fed, some rejected and rolled back); and the
executor's incremental block tables and tensor-built slot mapping equal a from-scratch
computation on every step."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.request import Request, RequestStatus
from kvpilot.engine.core.sampling_params import SamplingParams
from kvpilot.engine.core.scheduler import Scheduler, SchedulerLimits
from kvpilot.engine.spec_decode.speculator import drop_consumed, eligible
from kvpilot.engine.worker.step_inputs import BlockTables, StepInputs

BLOCK = 4


def _request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), max_tokens, frozenset({0}))


class Harness:
    """Drives the scheduler as the engine does, with a fake model that emits tokens
    derived from the sequence so far, and records what every block should contain."""

    def __init__(self, num_blocks: int, max_num_seqs: int, budget: int, prefix: bool, spec_k: int = 0) -> None:
        self.spec_k = spec_k  # speculation: up to spec_k drafts per decode, some rejected
        self.kv = KVCacheManager(num_blocks, BLOCK, prefix)
        self.sched = Scheduler(SchedulerLimits(max_num_seqs, budget, num_blocks * BLOCK), self.kv)
        self.contents: dict[int, list[int | None]] = {}  # block id -> tokens written
        self.next_id = 0
        self.all: list[Request] = []
        self.tables = BlockTables(rows=1, blocks_per_row=1)  # tiny, so both dimensions grow

    def add(self, prompt: list[int], max_tokens: int) -> None:
        req = _request(f"r{self.next_id}", prompt, max_tokens)
        self.all.append(req)
        self.sched.add_request(req)
        self.next_id += 1

    def step(self) -> None:
        out = self.sched.schedule()
        if out.scheduled:
            self.check_step_inputs(out, StepInputs.build(out, self.tables, BLOCK))
        sampled, tokens = [], []
        for item in out.scheduled:
            req = item.request
            table = req.kv.block_ids
            start = req.num_computed_tokens
            # Every already-computed position (incl. prefix hits) must hold the right token.
            for pos in range(start):
                written = self.contents.get(table[pos // BLOCK], [None] * BLOCK)[pos % BLOCK]
                assert written == req.all_token_ids[pos], "prefix hit returned different tokens"
            drafts = item.spec_token_ids
            fed = req.token_at(start, start + item.num_new_tokens - len(drafts)) + drafts
            for pos, token in enumerate(fed, start):
                self.contents.setdefault(table[pos // BLOCK], [None] * BLOCK)[pos % BLOCK] = token
            if item.samples:
                sampled.append(req)
                # The fake target accepts a prefix of the drafts, then emits its own token.
                accepted = sum(req.all_token_ids) % (len(drafts) + 1)
                tokens.append(drafts[:accepted] + [1 + sum(req.all_token_ids) % 7])  # never stop id 0
        self.sched.update(out, sampled, tokens)
        drop_consumed(out)  # as the engine's speculator does after each step
        self.check()
        for req in self.sched.running:
            # Rollback: no request holds a block past its tokens (the rejected drafts' slots).
            assert len(req.kv.block_ids) <= -(-req.num_tokens // BLOCK), "a rejected draft's block leaked"
            if self.spec_k and eligible(req):
                room = min(self.spec_k, req.max_tokens - len(req.output_token_ids) - 1)
                req.spec.token_ids = [1 + (len(req.all_token_ids) + j) % 5 for j in range(max(room, 0))]

    def check_step_inputs(self, out, step: StepInputs) -> None:
        """The step's inputs as the old per-token loop computed them from `block_ids`;
        and only running requests hold block-table rows (none leak), each its own."""
        holders = [r for r in self.all if r.row.table_row is not None]
        assert set(holders) <= set(self.sched.running)
        assert len({r.row.table_row for r in holders}) == len(holders)
        assert self.tables.table.shape[0] - len(self.tables._free_rows) == len(holders)
        ids, positions, slots = [], [], []
        for i, item in enumerate(out.scheduled):
            req, start = item.request, item.request.num_computed_tokens
            end = start + item.num_new_tokens
            ids += req.token_at(start, end - len(item.spec_token_ids)) + item.spec_token_ids
            positions += range(start, end)
            slots += [req.kv.block_ids[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]
            needed = -(-end // BLOCK)
            assert step.block_tables[i, :needed].tolist() == req.kv.block_ids[:needed]
            assert step.seq_lens[i] == end and step.query_lens[i] == item.num_new_tokens
        assert step.input_ids.tolist() == ids and step.positions.tolist() == positions
        assert step.slot_mapping.tolist() == slots
        assert step.sample_requests == [s.request for s in out.scheduled if s.samples]

    def abort_oldest(self) -> None:
        if self.sched.unfinished:
            self.sched.abort(next(iter(self.sched.unfinished)))
        self.check()

    def check(self) -> None:
        pool = self.kv.pool
        held: dict[int, int] = {}
        for req in self.all:
            ids = req.kv.block_ids
            assert len(ids) == len(set(ids)), "a request holds a block twice"
            for b in ids:
                held[b] = held.get(b, 0) + 1
        for block in pool.blocks:
            assert block.ref_cnt >= 0
            assert block.ref_cnt == held.get(block.block_id, 0), "reference count drifted"
        free = {b.block_id for b in pool.blocks if b.ref_cnt == 0}
        assert pool.num_free_blocks == len(free), "free queue disagrees with ref counts"
        assert {r.request_id for r in self.all if r.kv.block_ids} <= {
            r.request_id for r in self.sched.running
        } | {r.request_id for r in self.sched.waiting}
        assert len(self.sched.running) <= self.sched.limits.max_num_seqs
        for req in self.sched.running:
            assert req.status is RequestStatus.RUNNING


SHARED_PREFIXES = [[1, 2, 3, 4] * 4, [5, 4, 3, 2, 1] * 4, [1, 2, 3, 4] * 2 + [5] * 8]

actions = st.lists(
    st.one_of(
        # Prompts start with a shared prefix often enough that prefix hits are common.
        st.tuples(st.just("add"), st.integers(0, 16), st.integers(0, 2),
                  st.lists(st.integers(1, 5), max_size=8), st.integers(1, 8)),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort")),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    actions=actions,
    num_blocks=st.integers(8, 24),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 24),
    prefix=st.booleans(),
    spec_k=st.sampled_from([0, 0, 1, 3]),
)
def test_no_leak_no_double_free_prefix_hits_match(actions, num_blocks, max_num_seqs, budget, prefix, spec_k):
    h = Harness(num_blocks, max_num_seqs, budget, prefix, spec_k)
    for action in actions:
        if action[0] == "add":
            _, cut, which, suffix, max_tokens = action
            prompt = (SHARED_PREFIXES[which][:cut] + suffix) or [1]
            if len(prompt) + max_tokens <= num_blocks * BLOCK:
                h.add(prompt, max_tokens)
        elif action[0] == "step":
            h.step()
        else:
            h.abort_oldest()
    # Drain: everything finishes, then every block is free again.
    for _ in range(2000):
        if not h.sched.unfinished:
            break
        h.step()
    assert not h.sched.unfinished
    assert h.kv.pool.num_free_blocks == num_blocks
    assert all(b.ref_cnt == 0 for b in h.kv.pool.blocks)


def test_shared_prefix_is_hit_and_counted():
    h = Harness(num_blocks=16, max_num_seqs=4, budget=64, prefix=True)
    prefix = [1, 2, 3, 4, 5, 2, 3, 4, 1, 1, 2, 2]
    h.add(prefix + [3], 2)
    while h.sched.unfinished:
        h.step()
    h.add(prefix + [4], 2)
    h.step()
    second = h.sched.running[0] if h.sched.running else None
    assert h.kv.prefix_stats.hits == 12
    assert second is None or second.num_cached_tokens == 12


def test_preemption_recomputes_newest_first():
    # 4 blocks of 4 tokens: two requests of 6+4 tokens cannot both finish without preemption.
    h = Harness(num_blocks=4, max_num_seqs=2, budget=32, prefix=False)
    h.add([1] * 6, 4)
    h.add([2] * 6, 4)
    for _ in range(100):
        if not h.sched.unfinished:
            break
        h.step()
    assert not h.sched.unfinished
    assert h.sched.num_preemptions >= 1


def test_a_freed_request_gets_its_block_table_rewritten_and_tables_grow_intact():
    tables = BlockTables(rows=1, blocks_per_row=2)
    a, b = _request("a", [1], 4), _request("b", [2], 4)
    a.kv.block_ids = [5, 6, 7]  # more blocks than a row holds: the columns grow
    row_a = tables.sync(a)
    b.kv.block_ids = [3]
    row_b = tables.sync(b)  # no free row: the rows grow, a's row kept
    assert row_a != row_b and tables.table[row_a, :3].tolist() == [5, 6, 7]
    tables.release([a])  # preempted: its blocks were freed ...
    a.kv.block_ids = [1, 2]  # ... and on re-admission it holds others
    row = tables.sync(a)
    assert tables.table[row, :2].tolist() == [1, 2] and tables.table[row_b, :1].tolist() == [3]
    b.kv.block_ids.append(9)  # a decode that fills a block appends one id
    tables.sync(b)
    assert tables.table[row_b, :2].tolist() == [3, 9]


def test_a_trimmed_block_table_row_is_rewritten_past_what_the_trim_kept():
    """The KV cache manager never writes the executor's row state: a trim bumps its own
    version, and the next sync rewrites the row from the blocks the trim kept."""
    kv, tables = KVCacheManager(8, BLOCK, False), BlockTables(rows=1, blocks_per_row=1)
    a, b = _request("a", [1] * 5, 20), _request("b", [2], 20)
    assert kv.allocate_slots(a, 5 + 4) is not None  # 5 tokens and 4 drafts: 3 blocks
    row = tables.sync(a)
    kv.trim(a)  # all drafts rejected: back to 2 blocks
    kv.allocate_slots(b, 1)  # another request takes the freed block ...
    assert kv.allocate_slots(a, 5 + 4) is not None  # ... so a's third block is a new one
    assert tables.sync(a) == row and tables.table[row, :3].tolist() == a.kv.block_ids
