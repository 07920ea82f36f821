"""Speculative decoding on the simulated accelerator: the same tokens as without it, drafts
accepted at the configured rate, the metrics counted, no KV blocks leaked, and step times
that grow with the rows a verification adds. Every figure printed here is SIMULATED."""

from __future__ import annotations

import argparse
import math

import pytest

from kvpilot.engine.core.clock import VirtualClock
from kvpilot.engine.config.engine import EngineConfig
from kvpilot.engine.config.args import add_engine_args, engine_config_from_args
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.core.sampling_params import SamplingParams
from kvpilot.engine.spec_decode.speculator import SimulatedSpeculator

SIM = {"accelerator": "h200", "model": "llama-3.1-8b"}
NGRAM4 = {"method": "ngram", "num_speculative_tokens": 4}


def _engine(spec=None, sim=None, **kw) -> LLMEngine:
    cfg = EngineConfig(model=None, simulate={**SIM, **(sim or {})}, speculative_config=spec, **kw)
    return LLMEngine(cfg, VirtualClock(0.0))


def _drain(engine: LLMEngine) -> dict:
    """request id -> each choice's output (tokens, finish and stop reason, logprobs, text)."""
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = [(list(c.token_ids), c.finish_reason, c.stop_reason, c.logprobs,
                                      c.cumulative_logprob, c.text) for c in o.outputs]
    return out


def _mixed_workload(engine: LLMEngine) -> None:
    """Requests covering what speculation must not change: n > 1, EOS where the simulated
    output length puts it, ignore_eos, a stop token id the simulator produces at output
    position 10, min_tokens, logprobs, max_tokens below and between the drafts' reach,
    prompts longer than the token budget (chunked prefill)."""
    tokens = engine.runner.tokens
    stop_at_10 = tokens.token(7000, 10, ignore_eos=True)
    cases = [
        SamplingParams(max_tokens=60, n=3, seed=11),
        SamplingParams(max_tokens=80, ignore_eos=True, seed=22),
        SamplingParams(max_tokens=50, ignore_eos=True, seed=7000, stop_token_ids=[stop_at_10]),
        SamplingParams(max_tokens=40, min_tokens=9, seed=33),
        SamplingParams(max_tokens=30, ignore_eos=True, seed=44, logprobs=2),
        SamplingParams(max_tokens=7, ignore_eos=True, seed=55),  # cut inside the first drafts' reach
        SamplingParams(max_tokens=13, ignore_eos=True, n=2, seed=66),
        SamplingParams(max_tokens=70, seed=77, temperature=0.8),
    ]
    for i, params in enumerate(cases * 2):
        prompt = [1000 + (37 * i + j) % 20000 for j in range(20 + 45 * (i % 7))]  # 20..290 tokens
        engine.add_request(f"r{i}", prompt, params)


@pytest.mark.parametrize("spec", [NGRAM4, {"model": "not/loaded", "num_speculative_tokens": 3}],
                         ids=["ngram", "draft_model"])
def test_speculation_emits_exactly_the_tokens_plain_decoding_does(spec):
    # A small KV cache (384 tokens for 16 sequences of up to ~360) forces preemptions, and
    # a 64-token budget chunks every prefill and cuts drafts.
    small = dict(kv_cache_memory=24 * 16 * 131072, max_model_len=384, max_num_batched_tokens=64,
                 max_num_seqs=16)
    sim = {"output_len": "uniform:5:60"}
    plain, spec_engine = _engine(None, sim, **small), _engine(spec, sim, **small)
    assert isinstance(spec_engine.speculator, SimulatedSpeculator)
    for e in (plain, spec_engine):
        _mixed_workload(e)
    want, got = _drain(plain), _drain(spec_engine)
    assert got == want
    assert want["r2"][0][1] == "stop" and len(want["r2"][0][0]) == 11  # the stop id at position 10
    assert [len(c[0]) for c in want["r5"]] == [7]
    stats = spec_engine.stats()
    assert stats.num_preemptions_total > 0  # the path was exercised
    st = stats.spec_decode
    assert st.num_drafts > 0 and 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert st.accepted_per_pos[0] >= st.accepted_per_pos[-1]
    assert sum(st.accepted_per_pos) == st.num_accepted_tokens
    # Fewer steps for the same tokens, and no KV block left behind.
    assert spec_engine.runner.num_steps < plain.runner.num_steps
    assert stats.kv_cache_usage == 0.0
    assert spec_engine.kv_cache.pool.num_free_blocks == spec_engine.kv_cache.num_blocks


def test_acceptance_matches_the_configured_rate():
    """With K fixed (ignore_eos, long outputs, a budget that never cuts drafts), each
    verification checks drafts in order until the first wrong one: `accepted` successes and
    one failure per verification that did not accept all K. Independent positions make the
    per-position acceptance a binomial proportion, so the estimate's standard error is
    sqrt(a (1 - a) / trials); 4 of them bound a false failure at ~6e-5."""
    a, k = 0.6, 4
    e = _engine({**NGRAM4, "num_speculative_tokens": k}, {"spec_acceptance": a}, max_model_len=2048,
                max_num_batched_tokens=4096, max_num_seqs=64)
    for i in range(64):
        e.add_request(f"r{i}", [100 + i, 200 + i, 300 + i], SamplingParams(max_tokens=600, ignore_eos=True))
    _drain(e)
    st = e.stats().spec_decode
    full = st.accepted_per_pos[k - 1]  # verifications that accepted all k (rare cut drafts aside)
    trials = st.num_accepted_tokens + (st.num_drafts - full)
    est = st.num_accepted_tokens / trials
    se = math.sqrt(a * (1 - a) / trials)
    print(f"\nSIMULATED acceptance: configured {a}, measured {est:.4f} over {trials} draft positions "
          f"(4 se = {4 * se:.4f}); mean accepted length {1 + st.num_accepted_tokens / st.num_drafts:.3f} "
          f"vs (1 - a^(K+1)) / (1 - a) = {(1 - a ** (k + 1)) / (1 - a):.3f}")
    assert trials > 10000
    assert abs(est - a) < 4 * se
    # The first position alone: accepted in a fraction a of verifications.
    se1 = math.sqrt(a * (1 - a) / st.num_drafts)
    assert abs(st.accepted_per_pos[0] / st.num_drafts - a) < 4 * se1


def _throughput(batch: int, k: int, prompt: int, out: int = 128) -> tuple[float, float]:
    """(output tokens/s, mean step s) of `batch` requests served together, SIMULATED."""
    spec = {**NGRAM4, "num_speculative_tokens": k} if k else None
    e = _engine(spec, max_model_len=4096, max_num_seqs=max(batch, 1), max_num_batched_tokens=8192)
    for i in range(batch):
        e.add_request(f"r{i}", [1000 + (7 * i + j) % 5000 for j in range(prompt)],
                      SamplingParams(max_tokens=out, ignore_eos=True))
    _drain(e)
    now = e.clock.now()
    return batch * out / now, now / e.runner.num_steps


def test_speculation_pays_at_batch_1_and_little_once_the_step_is_compute_bound():
    """Default H200, Llama-3.1-8B, acceptance 0.7 (E(4) = 2.77 tokens per verification).
    Batch 1 reads the weights for one row: drafts ride free. At 256 sequences the GEMMs
    are compute-bound (H200: past ~170 rows), so 5 rows per sequence cost ~5x there; what
    still pays is that the step's fixed and per-sequence overheads and its K/V reads (read
    once per verification) are shared by more tokens, which with 1k-token contexts is
    enough to keep speculation ahead."""
    rows = {}
    print("\nSIMULATED h200 llama-3.1-8b, 128 output tokens, acceptance 0.7: output tokens/s")
    for prompt in (128, 1024):
        for batch in (1, 256):
            (t0, s0), (t4, s4) = _throughput(batch, 0, prompt), _throughput(batch, 4, prompt)
            rows[prompt, batch] = (t0, t4, s0, s4)
            print(f"  prompt {prompt:5d} batch {batch:4d}: K=0 {t0:8.0f}  K=4 {t4:8.0f}  "
                  f"({t4 / t0:.2f}x; mean step {1000 * s0:.1f} -> {1000 * s4:.1f} ms)")
    t0, t4, s0, s4 = rows[128, 1]
    assert t4 > 2.0 * t0  # memory-bound: drafts nearly free
    t0, t4, s0, s4 = rows[128, 256]
    assert s4 > 2.0 * s0  # rows grow with K: the step costs more ...
    assert t4 < 1.15 * t0  # ... and eats nearly all of the gain
    t0, t4, _, _ = rows[1024, 256]
    assert t4 > t0  # long contexts: the K/V reads, shared by 1 + K rows, keep it ahead


def test_draft_model_passes_are_charged():
    ngram = _throughput(8, 4, 128)
    e_cost = EngineConfig(model=None, simulate=SIM, speculative_config={"model": "x", "num_speculative_tokens": 4})
    assert LLMEngine(e_cost, VirtualClock(0.0)).runner.draft_cost == pytest.approx(0.1)
    spec = {"model": "x", "num_speculative_tokens": 4}
    e = _engine(spec, max_model_len=4096)
    for i in range(8):
        e.add_request(f"r{i}", [1000 + i + j for j in range(128)], SamplingParams(max_tokens=128, ignore_eos=True))
    _drain(e)
    assert 8 * 128 / e.clock.now() < ngram[0]  # same drafts, plus the draft model's time


def test_simulation_flags_and_their_validation():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = engine_config_from_args(parser.parse_args(
        ["--simulate", "h200", "--simulate-model", "llama-3.1-8b", "--simulate-spec-acceptance", "0.5",
         "--simulate-spec-draft-cost", "0.2", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']))
    assert cfg.simulate.spec_acceptance == 0.5 and cfg.simulate.spec_draft_cost == 0.2
    assert cfg.speculative_config.num_speculative_tokens == 2
    for field, bad in (("spec_acceptance", 0), ("spec_acceptance", 1.5), ("spec_acceptance", float("nan")),
                       ("spec_draft_cost", -0.1), ("spec_draft_cost", 2), ("spec_acceptance", True)):
        with pytest.raises(ValueError, match=f"simulate_{field}"):
            EngineConfig(model=None, simulate={**SIM, field: bad})
    # A draft model still has to be named (the same config serves real pods), not loaded.
    with pytest.raises(ValueError, match="speculative_config.model"):
        EngineConfig(model=None, simulate=SIM, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})


def test_live_k_changes_and_zero_turns_drafting_off():
    e = _engine(NGRAM4, max_model_len=4096)
    e.update_limits(num_speculative_tokens=0)
    for i in range(4):
        e.add_request(f"r{i}", [1000 + i + j for j in range(64)], SamplingParams(max_tokens=50, ignore_eos=True))
    _drain(e)
    assert e.stats().spec_decode.num_drafts == 0 and e.stats().num_speculative_tokens == 0
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        e.update_limits(num_speculative_tokens=5)  # above the configured ceiling
