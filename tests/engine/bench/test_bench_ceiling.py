"""`bench throughput --ceiling`: the workload's FLOPs (by hand, and against a reference
forward), the ceiling's arithmetic, and the flag end to end on a tiny model."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from kvpilot.engine.bench import ceiling as bench_ceiling
from kvpilot.engine.bench.ceiling import (Ceiling, MatmulRates, Work, attention_flops, measure_rates,
                                          workload_flops)
from kvpilot.engine.cli import main
from kvpilot.engine.config.model import ModelConfig

# 1 layer, hidden 8, 2 heads and 1 KV head of 4, intermediate 16, vocab 32.
TINY = ModelConfig(architecture="llama", vocab_size=32, hidden_size=8, intermediate_size=16,
                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                   max_position_embeddings=64)


def test_the_flops_of_two_requests_by_hand():
    work = workload_flops(TINY, [(3, 2), (1, 1)])
    # per token: 2 * (qkv 8*(8+4+4) + o 8*8 + gate/up/down 3*8*16) = 2 * 576
    assert work.prefill_layers == (3 + 1) * 1152  # every prompt token
    assert work.decode_layers == 1 * 1152  # the last generated token is never fed back
    assert work.lm_head == (2 + 1) * 2 * 8 * 32  # one position per output token
    # positions 0..3 and 0: (1+2+3+4) + 1 keys, each 2*2*heads*head_dim
    assert work.attention == 11 * 2 * 2 * 2 * 4
    assert work.total == 4608 + 1152 + 1536 + 352


def test_attention_is_the_sum_over_positions():
    cfg = replace(TINY, num_hidden_layers=3, num_attention_heads=4)
    for n in (1, 2, 17):
        assert attention_flops(cfg, n) == sum(2 * 2 * 4 * 4 * 3 * (p + 1) for p in range(n))
    assert workload_flops(cfg, [(5, 4)]).attention == attention_flops(cfg, 8)


def test_the_linears_match_a_reference_forward():
    """The matmuls a reference Llama forward of P tokens runs (logits at every position)."""
    from torch.utils.flop_counter import FlopCounterMode

    from kvpilot.engine.models.llama_train import TrainableLlama

    cfg = replace(TINY, num_hidden_layers=2)
    model = TrainableLlama(cfg, 64).eval()
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model(torch.zeros(1, 5, dtype=torch.long))
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    linears = sum(n for op, n in counts.items() if op in ("aten.mm", "aten.addmm"))
    work = workload_flops(cfg, [(5, 1)])
    assert work.decode_layers == 0
    assert linears == work.prefill_layers + 5 * work.lm_head


def test_the_ceiling_from_fixed_rates():
    rates = MatmulRates(prefill=4e9, decode=1e9, lm_head=2e9, prefill_rows=2048, decode_rows=8)
    c = Ceiling(Work(prefill_layers=8e9, decode_layers=3e9, lm_head=2e9, attention=4e9), rates, 500)
    assert c.seconds == pytest.approx(2 + 3 + 1 + 1)
    assert c.output_tokens_per_s == pytest.approx(500 / 7)
    assert c.as_dict()["work_flop"]["total"] == 17e9


def test_measured_rates_are_positive():
    r = measure_rates(TINY, prefill_rows=16, decode_rows=2, min_time_s=0.001)
    assert min(r.prefill, r.decode, r.lm_head) > 0 and (r.prefill_rows, r.decode_rows) == (16, 2)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("ceiling") / "m"
    assert main(["make-tiny-model", str(out), "--layers", "2", "--hidden", "64", "--heads", "4",
                 "--kv-heads", "2", "--intermediate", "128", "--vocab", "512"]) == 0
    return str(out)


def bench(model: str, *extra: str) -> list[str]:
    return ["bench", "throughput", "--model", model, "--dtype", "float32", "--num-prompts", "4",
            "--input-len", "16", "--output-len", "8", "--ceiling", *extra]


def test_bench_throughput_prints_the_ceiling(small_model, monkeypatch, capsys):
    monkeypatch.setattr(bench_ceiling, "MIN_TIME_S", 0.001)
    assert main(bench(small_model)) == 0
    out = capsys.readouterr().out
    assert out.index("Throughput Benchmark Result (kvpilot)") < out.index("Arithmetic Ceiling")
    assert "Work (TFLOP):" in out and "(layer matmuls " in out and ", attention " in out
    assert "Matmul GFLOP/s:" in out and "at 64 rows, decode " in out and "at 4 rows, LM head " in out
    assert "Ceiling output tok/s:" in out
    assert "kvpilot at " in out and "% of the ceiling" in out

    assert main([*bench(small_model), "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    ceiling = result["ceiling"]
    assert ceiling["output_tokens"] == result["output_tokens"] == 32
    assert ceiling["matmul_flop_per_s"]["prefill_rows"] == 4 * 16
    assert result["fraction_of_ceiling"] == pytest.approx(
        result["output_tokens_per_s"] / ceiling["output_tokens_per_s"])


@pytest.mark.parametrize("flags, said", [(["--device", "cuda"], "--device cpu"),
                                         (["--dtype", "bfloat16"], "--dtype float32"),
                                         (["--quantization", "int8"], "quantized")])
def test_the_ceiling_refuses_runs_it_does_not_bound(small_model, capsys, flags, said):
    assert main([*bench(small_model), *flags]) == 2
    err = capsys.readouterr().err
    assert "--ceiling" in err and said in err
