"""CUDA-graph decode: the bucket ladder, the padding into persistent buffers, and (off
CUDA, with the buckets left uncaptured) the same padded forward giving the eager tokens."""

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.tiny.model import make_tiny_model
from kvpilot.engine.worker.cuda_graphs import DecodeBuffers, DecodeRows, bucket_for, capture_sizes


def test_capture_sizes_follow_vllms_ladder():
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(1024)[-1] == 256  # capped
    assert capture_sizes(12) == [1, 2, 4, 8, 12]  # max_num_seqs is itself a bucket
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]


def test_bucket_for_picks_the_smallest_that_holds_the_batch():
    sizes = capture_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 63, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert bucket_for(65, sizes) is None  # above the largest: eager


def test_stage_pads_rows_into_the_scratch_block():
    buffers = DecodeBuffers(size=8, table_width=4, device=torch.device("cpu"))
    rows = DecodeRows(input_ids=torch.tensor([11, 12, 13]), positions=torch.tensor([5, 0, 17]),
                      slot_mapping=torch.tensor([21, 48, 33]),
                      block_tables=torch.tensor([[1, 0], [3, 0], [6, 2]], dtype=torch.int32),
                      seq_lens=torch.tensor([6, 1, 18], dtype=torch.int32))
    buffers.stage(rows, bucket=4, scratch_block=9, block_size=16)
    assert buffers.ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.positions[:4].tolist() == [5, 0, 17, 0]
    assert buffers.slots[:4].tolist() == [21, 48, 33, 9 * 16]  # the pad writes the scratch slot
    assert buffers.tables[:4, :2].tolist() == [[1, 0], [3, 0], [6, 2], [9, 0]]
    assert buffers.seq_lens[:4].tolist() == [6, 1, 18, 1]  # ... and reads only that slot
    meta = buffers.metadata(4, max_seq_len=64)
    assert meta.is_decode_only and meta.num_seqs == 4
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.slot_mapping.data_ptr() == buffers.slots.data_ptr()  # fixed addresses
    with pytest.raises(ValueError, match="do not fit"):
        buffers.stage(rows, bucket=2, scratch_block=9, block_size=16)
    wide = DecodeRows(*(getattr(rows, f) for f in ("input_ids", "positions", "slot_mapping")),
                      torch.zeros((3, 5), dtype=torch.int32), rows.seq_lens)
    with pytest.raises(ValueError, match="do not fit"):
        buffers.stage(wide, bucket=4, scratch_block=9, block_size=16)


def test_cpu_runs_eagerly_and_says_so(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="16Mi")
    runner = llm.engine.runner
    assert not runner.use_cuda_graphs and runner.graphs is None


@pytest.mark.slow
def test_padded_decode_path_gives_the_eager_tokens(tmp_path):
    """The graph path's staging, padding and scratch block, run uncaptured on the CPU with
    the Triton kernels (interpreted): greedy tokens equal the eager engine's. A one-layer
    model with few heads: the interpreter's time grows with layers x heads, the property
    does not depend on them (GQA kept: 4 query heads on 2 KV heads)."""
    model_dir = make_tiny_model(tmp_path / "model", layers=1, hidden=64, heads=4, kv_heads=2,
                                intermediate=128, vocab=512)
    prompts = [[17, 40, 99, 3, 250], [8] * 19, [300, 301]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def generate(padded: bool) -> list[list[int]]:
        llm = LLM(model=str(model_dir), dtype="float32", attention_backend="triton",
                  kv_cache_memory="16Mi", max_num_seqs=5, block_size=8)
        runner = llm.engine.runner
        if padded:
            runner.use_cuda_graphs = True
            runner.allocate_kv_cache(llm.engine.kv_cache.num_blocks)
            assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4, 5]
            replays = []
            run = runner.graphs.run
            runner.graphs.run = lambda rows: replays.append(len(rows.input_ids)) or run(rows)
        outs = llm.generate(prompts, params, use_tqdm=False)
        if padded:  # every decode step went through the buffers, padded 3 -> 4 at first
            assert replays[0] == 3 and len(replays) >= 5
        return [o.outputs[0].token_ids for o in outs]

    assert generate(padded=True) == generate(padded=False)
