"""StepStaging: an eager step's metadata packed into two buffers and sliced back out
equals what went in, buffers are reused while a step fits and grown when not."""

import random

import torch
from hypothesis import given, settings, strategies as st

from kvpilot.engine.worker.step_staging import StepStaging


def _step(rng: random.Random, num_seqs: int, width: int):
    query_lens = [rng.randint(1, 40) for _ in range(num_seqs)]
    seq_lens = [q + rng.randint(0, 200) for q in query_lens]
    t = sum(query_lens)
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    return (torch.randint(0, 32000, (t,)), torch.randint(0, 4096, (t,)), torch.randint(0, 10**6, (t,)),
            torch.randint(0, 5000, (num_seqs, width), dtype=torch.int32), seq_lens, qsl)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shapes=st.lists(
    st.tuples(st.integers(1, 12), st.integers(1, 30)), min_size=1, max_size=6))
def test_upload_round_trips_every_field_across_steps(seed, shapes):
    rng = random.Random(seed)
    staging = StepStaging(torch.device("cpu"))
    for num_seqs, width in shapes:
        ids, pos, slots, tables, seq_lens, qsl = _step(rng, num_seqs, width)
        got = staging.upload(ids, pos, slots, tables, seq_lens, qsl)
        assert torch.equal(got.input_ids, ids) and torch.equal(got.positions, pos)
        assert torch.equal(got.slot_mapping, slots) and torch.equal(got.block_tables, tables)
        assert got.seq_lens.tolist() == seq_lens and torch.equal(got.query_start_loc, qsl)
        assert got.seq_lens.dtype == got.block_tables.dtype == got.query_start_loc.dtype == torch.int32


def test_buffers_are_reused_while_a_step_fits_and_doubled_when_not():
    rng = random.Random(0)
    staging = StepStaging(torch.device("cpu"))
    first = staging.upload(*_step(rng, 8, 10))
    buffer64 = staging._dev64.data_ptr()
    smaller = staging.upload(*_step(rng, 4, 5))
    assert staging._dev64.data_ptr() == buffer64 and smaller.input_ids.data_ptr() == buffer64
    assert first.input_ids.data_ptr() == buffer64  # views of one persistent buffer
    capacity = staging._host32.shape[0]
    staging.upload(*_step(rng, 12, 30))
    assert staging._host32.shape[0] >= max(2 * capacity, 13 + 12 + 12 * 30)
