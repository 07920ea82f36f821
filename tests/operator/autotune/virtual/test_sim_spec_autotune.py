"""The autotuner's speculation rule on the simulated fleet, in virtual time: the fleet's
pods export vllm:spec_decode_* and kvpilot:num_speculative_tokens, the operator's own
reader queries them, and the policy's K changes reach the engines (update_limits). Every
figure printed here is SIMULATED (default H200, Llama-3.1-8B, acceptance 0.7)."""

from __future__ import annotations

from kvpilot.engine.config.engine import EngineConfig
from kvpilot.engine.fleet.fleet import Fleet
from kvpilot.engine.fleet.trace import TraceRequest
from kvpilot.operator.autotune.decision import Bounds, Range, Thresholds
from kvpilot.operator.autotune.virtual.autotuner import AutotuneSettings, current_settings, run_autotuned

SETTING = "num_speculative_tokens"
PROMPT, OUTPUT = 128, 128  # short contexts: the decode step is GEMM-, i.e. compute-, bound at 256


def _fleet(concurrency: int, prompt: int = PROMPT) -> Fleet:
    cfg = EngineConfig(model=None, simulate={"accelerator": "h200", "model": "llama-3.1-8b"},
                       speculative_config={"method": "ngram", "num_speculative_tokens": 4},
                       max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=8192)
    # Closed loop, as `bench serve --max-concurrency`: the batch stays at `concurrency`.
    return Fleet(cfg, scrape_interval=2.5, max_concurrency=concurrency)


def _tune() -> AutotuneSettings:
    # An LLMDeployment in Auto with a compressed control loop (5 s interval, 20 s window and
    # cooldown); no numSpeculativeTokens bounds, so [0, the configured 4] as the operator's.
    return AutotuneSettings(mode="Auto", interval_s=5.0, window_s=20.0,
                            bounds=Bounds(Range(1, 256), Range(128, 4096), Range(1, 1)),
                            thresholds=Thresholds(cooldown_s=20.0))


def _trace(n: int, prompt: int = PROMPT) -> list[TraceRequest]:
    return [TraceRequest(0.0, prompt, OUTPUT) for _ in range(n)]


def test_heavy_load_turns_speculation_off_and_verification_keeps_it():
    fleet = _fleet(256)
    intervals = run_autotuned(fleet, _trace(8000), _tune())
    changes = [iv for iv in intervals if iv.applied and SETTING in iv.decision.change]
    assert changes, [iv.decision.reason for iv in intervals]
    first = changes[0]
    print(f"\nSIMULATED heavy load (256 in flight): t={first.time:.0f}s {first.decision.reason}")
    old, new = first.decision.change[SETTING]
    assert (old, new) == (4, 0)
    assert "speculation costs more than it earns" in first.decision.reason
    assert first.snapshot.spec_mean_accepted_len is not None
    assert abs(first.snapshot.spec_mean_accepted_len - 2.77) < 0.1  # E(4) at 0.7, read through PromQL
    # The engines run with it, and verification keeps it: TPOT did not get worse.
    assert all(r.engine.num_speculative_tokens == 0 for r in fleet.replicas)
    judged = [iv for iv in intervals if iv.decision.verifies == first.time and iv.decision.verified is not None]
    assert judged and judged[0].decision.verified is True, [iv.decision.reason for iv in intervals]
    assert not any(iv.decision.action.value == "revert" for iv in intervals)
    before, after = first.snapshot, judged[0].snapshot
    print(f"SIMULATED TPOT mean {1000 * before.tpot_mean_s:.1f} ms -> {1000 * after.tpot_mean_s:.1f} ms, "
          f"output {before.generation_tokens_per_s:.0f} -> {after.generation_tokens_per_s:.0f} tokens/s; "
          f"{judged[0].decision.reason.split('; ')[-1]}")
    assert after.tpot_mean_s <= 1.05 * before.tpot_mean_s
    assert after.generation_tokens_per_s >= 0.95 * before.generation_tokens_per_s


def test_light_load_leaves_speculation_on():
    fleet = _fleet(4)
    intervals = run_autotuned(fleet, _trace(1200), _tune())
    assert intervals[-1].time >= 60.0  # several windows of steady load were judged
    assert not any(SETTING in iv.decision.change for iv in intervals), [iv.decision.reason for iv in intervals]
    assert all(iv.num_speculative_tokens == 4 for iv in intervals)
    loaded = [iv.snapshot for iv in intervals if iv.snapshot.tpot_mean_s and iv.snapshot.spec_mean_accepted_len]
    s = loaded[len(loaded) // 2]
    print(f"\nSIMULATED light load (4 in flight), K=4 kept: TPOT mean {1000 * s.tpot_mean_s:.1f} ms, "
          f"{s.spec_mean_accepted_len:.2f} tokens per verification, {s.spec_acceptance_rate:.0%} of drafts "
          f"accepted, output {s.generation_tokens_per_s:.0f} tokens/s")
    assert abs(s.spec_mean_accepted_len - 2.77) < 0.2


def test_live_k_reaches_every_replica_and_later_ones():
    fleet = _fleet(4)
    assert current_settings(fleet).num_speculative_tokens == 4
    fleet.set_limits(num_speculative_tokens=2, max_num_seqs=64)
    fleet.add_replica()
    assert [r.engine.num_speculative_tokens for r in fleet.replicas] == [2, 2]
    assert [r.engine.max_num_seqs for r in fleet.replicas] == [64, 64]
    samples = {s.name: s.value for s in fleet.replicas[1].metrics.samples()}
    assert samples["kvpilot:num_speculative_tokens"] == 2.0
    assert samples["vllm:spec_decode_num_drafts_total"] == 0.0


def test_at_long_contexts_a_k_change_that_cost_tpot_is_reverted():
    """1k-token prompts at 256 in flight: the drafts share each sequence's KV reads, which
    dominate the step here, so speculation still pays in the timing model while the rule's
    rows-only cost model calls it a loss. Turning it off then costs TPOT, and verification
    (a K change may only cost TPOT noise: Thresholds.spec_worse_rel) puts K back."""
    fleet = _fleet(256)
    intervals = run_autotuned(fleet, _trace(3500, prompt=1024), _tune())
    changes = [iv for iv in intervals if iv.applied and SETTING in iv.decision.change]
    assert changes and changes[0].decision.change[SETTING] == (4, 0), [iv.decision.reason for iv in intervals]
    first = changes[0]
    judged = [iv for iv in intervals if iv.decision.verifies == first.time and iv.decision.verified is not None]
    assert judged, [iv.decision.reason for iv in intervals]
    print(f"\nSIMULATED long contexts (1k-token prompts, 256 in flight): {judged[0].decision.reason}")
    assert judged[0].decision.verified is False
    assert judged[0].decision.action.value == "revert" and judged[0].decision.change[SETTING] == (0, 4)
    assert all(r.engine.num_speculative_tokens == 4 for r in fleet.replicas)
    # The reverted move is not retried at once (flip backoff).
    later = [iv for iv in intervals if iv.time > judged[0].time and iv.applied and SETTING in iv.decision.change]
    assert all(iv.time - judged[0].time >= _tune().thresholds.flip_backoff_s for iv in later)
