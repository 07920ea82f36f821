"""`kvpilot bench overhead`: the window medians, and the command end to end on the tiny
model (a short output; the 4,000-token figure is a benchmark, not a test)."""

import pytest

from kvpilot.engine.bench.overhead import window
from kvpilot.engine.cli import main


def test_window_medians_gap_forward_and_outside():
    gaps = [9.0] + [0.010] * 10 + [0.020] * 10  # token 0 waits for the prefill
    forwards = [9.0] + [0.008] * 10 + [0.008] * 10
    early, late = window(gaps, forwards, 5, 2), window(gaps, forwards, 15, 2)
    assert early.gap_ms == pytest.approx(10.0) and early.forward_ms == pytest.approx(8.0)
    assert early.outside_ms == pytest.approx(2.0) and late.outside_ms == pytest.approx(12.0)
    assert window(gaps, forwards, 0, 1).gap_ms == pytest.approx(10.0)  # token 0 is never counted
    with pytest.raises(ValueError, match="outside"):
        window(gaps, forwards, 40, 2)


def test_bench_overhead_runs_end_to_end(tiny_model_dir, capsys):
    assert main(["bench", "overhead", "--model", str(tiny_model_dir), "--kv-cache-memory", "16Mi",
                 "--output-len", "60", "--positions", "10,45", "--window", "5"]) == 0
    out = capsys.readouterr().out
    assert "60 tokens" in out and "outside the forward pass, token 45 vs 10" in out


@pytest.mark.parametrize("argv,message", [
    (["--positions", "10,x"], "--positions"),
    (["--positions", "10,58"], "must lie below --output-len"),
    (["--prompt-len", "4000", "--output-len", "4000"], "exceeds max_model_len"),
])
def test_bench_overhead_refuses_bad_flags(tiny_model_dir, argv, message, capsys):
    base = ["bench", "overhead", "--model", str(tiny_model_dir), "--kv-cache-memory", "16Mi",
            "--output-len", "60"]
    assert main(base + argv) != 0
    assert message in capsys.readouterr().err
