"""Calibration: the fit recovers a known description from its own step times, the
repeats of a grid shape pool at their median, and the recorder times a real engine."""

from __future__ import annotations

import math

import pytest

from kvpilot.engine.fleet.calibrate import errors, fit, measured_shapes, nelder_mead
from kvpilot.engine.sim.hardware import Accelerator
from kvpilot.engine.sim.shapes import resolve_model_shape
from kvpilot.engine.sim.steps import StepRecord, read_records, record_grids, write_records
from kvpilot.engine.sim.timing import BatchShape, step_time

MODEL = resolve_model_shape("llama-3.1-8b")
TRUE = Accelerator(name="true", memory_bytes=80 * 2**30, bandwidth=3e12, flops=1e15, bandwidth_efficiency=0.6,
                   gemm_efficiency=0.5, attention_efficiency=0.3, step_overhead_s=2e-3, per_seq_overhead_s=30e-6,
                   per_token_overhead_s=1e-6, attention_score_bytes=0.0)


def _records(shapes, acc=TRUE, kind="decode", scale=1.0):
    return [StepRecord(list(s), len(s), scale * step_time(MODEL, acc, BatchShape.of(list(s))), kind)
            for s in shapes]


CAL = [[(1, c)] * b for b in (1, 4, 16, 64) for c in (256, 2048)] + [[(n, n)] for n in (128, 1024, 4096)] + [
    [(512, 512)] + [(1, 1000)] * 8, [(2048, 4096)] + [(1, 300)] * 32]
VAL = [[(1, c)] * b for b in (2, 8, 32) for c in (512, 4096)] + [[(n, n)] for n in (256, 2048)]


def test_nelder_mead_finds_a_minimum():
    x = nelder_mead(lambda p: (p[0] - 3) ** 2 + 10 * (p[1] + 1) ** 2 + 1, [0.0, 0.0])
    assert x[0] == pytest.approx(3, abs=1e-3) and x[1] == pytest.approx(-1, abs=1e-3)


def test_the_fit_recovers_a_description_from_its_own_step_times():
    base = Accelerator(name="h100-ish", memory_bytes=80 * 2**30, bandwidth=3.35e12, flops=989e12)
    acc, report = fit(MODEL, base, _records(CAL))
    assert report.median_abs_rel < 0.02
    val = errors(MODEL, acc, _records(VAL))
    assert val.median_abs_rel < 0.03 and val.p90_abs_rel < 0.06
    assert 0 < acc.bandwidth_efficiency <= 1 and acc.source.startswith("kvpilot sim calibrate")


def test_repeats_of_a_grid_shape_count_once_at_their_median():
    shape = [(1, 100)] * 4
    recs = [StepRecord(shape, 4, t, "decode", label="g decode 4x100 step 3") for t in (0.010, 0.011, 0.050)]
    recs.append(StepRecord([(64, 64)], 1, 0.02, "prefill"))
    pooled = measured_shapes(recs)
    assert sorted(s for _, s in pooled) == [0.011, 0.02]
    assert errors(MODEL, TRUE, _records([shape], scale=2.0)).mean_signed_rel == pytest.approx(-0.5)


def test_a_fit_needs_enough_steps_and_files_must_hold_them(tmp_path):
    with pytest.raises(ValueError, match="at least"):
        fit(MODEL, TRUE, _records(CAL[:2]))
    (tmp_path / "x.json").write_text('{"steps": []}')
    with pytest.raises(ValueError, match="no 'steps' list"):
        read_records(tmp_path / "x.json")
    with pytest.raises(ValueError, match="cannot read"):
        read_records(tmp_path / "missing.json")


def test_the_recorder_times_the_real_engine_on_the_smoke_grid(tmp_path):
    from kvpilot.engine.config.engine import EngineConfig
    from kvpilot.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="builtin:tiny", kv_cache_memory="16Mi", enable_prefix_caching=False))
    recs = record_grids(engine, ["smoke"])
    kinds = {r.kind for r in recs}
    assert {"decode", "prefill"} <= kinds and all(r.seconds > 0 and r.grid == "smoke" for r in recs)
    full = [r for r in recs if r.kind == "decode" and len(r.requests) == 2]
    assert len(full) >= 3 and all(r.label.startswith("smoke decode 2x16 step") for r in full)
    assert not engine.has_unfinished_requests()
    write_records(tmp_path / "s.json", recs, {"model": "builtin:tiny"})
    back, meta = read_records(tmp_path / "s.json")
    assert len(back) == len(recs) and meta["model"] == "builtin:tiny"
    with pytest.raises(ValueError, match="grid must be"):
        record_grids(engine, ["nope"])
    assert math.isfinite(errors(resolve_model_shape("builtin:tiny", "float32"), TRUE, back).median_abs_rel)
