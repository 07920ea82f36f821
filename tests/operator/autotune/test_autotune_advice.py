"""Restart-only advice: an fp8 KV cache recommended (never applied) while the cache's size
binds, with the capacity it would give, in status.autotune.advice and one Event."""

from __future__ import annotations

from test_autotune_hook import PREEMPTING, QUEUED_FULL, T0, FakeKube, FakeReader, ctx, snap, spec_body

from kvpilot.operator.autotune.advice import restart_advice
from kvpilot.operator.autotune.capacity import plan_capacity
from kvpilot.operator.autotune.decision import Diagnosis
from kvpilot.operator.autotune.hook import autotune_step

MiB = 2**20


def _plan(max_num_seqs=64, element=4):
    # 2 MiB at 4 KiB/token (float32 tiny): 512 tokens, 3 sequences of 160; fp8 1 KiB/token: 12.
    return plan_capacity(seq_len=160, max_num_seqs=max_num_seqs, kv_cache_memory=2 * MiB, bytes_per_token=4096,
                         kv_element_bytes=element, weight_bytes=9 * MiB)


def test_the_capacity_plan_says_what_an_fp8_cache_and_the_weights_take():
    plan = _plan()
    assert (plan.max_concurrent_seqs, plan.fp8_max_concurrent_seqs, plan.weight_bytes) == (3, 12, 9 * MiB)
    assert "an fp8 KV cache (1.0 KiB/token) would hold 12" in plan.summary and "weights take 9.0 MiB" in plan.summary
    status = plan.to_status()
    assert status["fp8MaxConcurrentSeqs"] == 12 and status["weightBytes"] == 9 * MiB
    bf16 = plan_capacity(seq_len=160, max_num_seqs=8, kv_cache_memory=2 * MiB, bytes_per_token=2048,
                         kv_element_bytes=2)
    assert (bf16.max_concurrent_seqs, bf16.fp8_max_concurrent_seqs) == (6, 12)
    # Already fp8, or sizes unknown: no figure, and the status leaves the keys out.
    for element in (1, None):
        same = plan_capacity(seq_len=160, max_num_seqs=8, kv_cache_memory=2 * MiB, bytes_per_token=1024,
                             kv_element_bytes=element)
        assert same.fp8_max_concurrent_seqs is None and "fp8MaxConcurrentSeqs" not in same.to_status()


def test_fp8_is_advised_only_while_the_caches_size_binds():
    s = snap(**PREEMPTING, kv_cache_element_bytes=4)
    (advice,) = restart_advice(Diagnosis.PREEMPTION_BOUND, s, _plan(), kv_cache_dtype=None, simulated=False)
    assert (advice.setting, advice.value) == ("engine.kvCacheDtype", "fp8")
    assert "holds 3 sequences of 160 tokens" in advice.reason and "fp8 would hold 12" in advice.reason
    assert "restart" in advice.reason and "advised, not applied" in advice.reason
    assert restart_advice(Diagnosis.KV_CACHE_BOUND, s, _plan(), kv_cache_dtype="auto", simulated=False)
    # HardwareBound: only when the plan says the cache (not max_num_seqs) is what binds.
    assert restart_advice(Diagnosis.HARDWARE_BOUND, s, _plan(64), kv_cache_dtype=None, simulated=False)
    assert restart_advice(Diagnosis.HARDWARE_BOUND, s, _plan(2), kv_cache_dtype=None, simulated=False) == []
    assert restart_advice(Diagnosis.HARDWARE_BOUND, s, None, kv_cache_dtype=None, simulated=False) == []
    # ... and only while the cache is full in fact, not just by the p99 formula.
    roomy = snap(**{**PREEMPTING, "kv_usage_mean": 0.3}, kv_cache_element_bytes=4)
    assert restart_advice(Diagnosis.HARDWARE_BOUND, roomy, _plan(64), kv_cache_dtype=None, simulated=False) == []
    # Without a plan the pods' element size still gives the factor.
    (plain,) = restart_advice(Diagnosis.PREEMPTION_BOUND, s, None, kv_cache_dtype=None, simulated=False)
    assert "4x the tokens" in plain.reason
    for diagnosis in (Diagnosis.SCHEDULER_BOUND, Diagnosis.TPOT_BOUND, Diagnosis.HEALTHY, Diagnosis.IDLE,
                      Diagnosis.LENGTH_BOUND, Diagnosis.NO_DATA):
        assert restart_advice(diagnosis, s, _plan(), kv_cache_dtype=None, simulated=False) == []


def test_no_fp8_advice_where_it_is_already_fp8_unknown_or_not_modelled():
    args = (Diagnosis.PREEMPTION_BOUND,)
    assert restart_advice(*args, snap(**PREEMPTING, kv_cache_element_bytes=4), _plan(),
                          kv_cache_dtype="fp8", simulated=False) == []
    assert restart_advice(*args, snap(**PREEMPTING, kv_cache_element_bytes=1), _plan(1),
                          kv_cache_dtype=None, simulated=False) == []  # pods already 8-bit
    assert restart_advice(*args, snap(**PREEMPTING), _plan(), kv_cache_dtype=None,
                          simulated=False) == []  # stock vLLM pods: no element size
    assert restart_advice(*args, snap(**PREEMPTING, kv_cache_element_bytes=2), _plan(),
                          kv_cache_dtype=None, simulated=True) == []  # engine.simulate refuses fp8
    assert restart_advice(*args, None, _plan(), kv_cache_dtype=None, simulated=False) == []


def test_the_hook_writes_the_advice_applies_nothing_of_it_and_announces_it_once():
    kube = FakeKube()
    preempting = snap(**PREEMPTING, kv_cache_element_bytes=4, weight_bytes=9 * MiB)
    out = autotune_step(ctx(spec_body(), kube=kube), reader_factory=FakeReader([preempting]), now=T0)
    r = out.status()
    assert r.capacity.fp8_max_concurrent_seqs == 12 and r.capacity.weight_bytes == 9 * MiB
    ((advice),) = r.advice
    assert (advice.setting, advice.value) == ("engine.kvCacheDtype", "fp8") and advice.since
    assert out.proposed.max_num_seqs == 32 and "kv_cache_dtype" not in out.proposed.model_dump()
    out.announce()
    assert [e[3] for e in kube.events] == ["AutotuneChange", "AutotuneAdvice"]
    assert "set spec.engine.kvCacheDtype: fp8" in kube.events[1][4]

    # The next interval gives the same advice: kept with its first time, no second Event.
    later = snap(t=T0 + 60, seqs=32, **QUEUED_FULL, kv_cache_element_bytes=4)
    kube.events.clear()
    out2 = autotune_step(ctx(spec_body(seqs=32), status={"autotune": r.dump()}, kube=kube),
                         reader_factory=FakeReader([later]), now=T0 + 60)
    r2 = out2.status()
    assert r2.diagnosis in ("KVCacheBound", "PreemptionBound", "HardwareBound")
    assert [(a.setting, a.since) for a in r2.advice] == [("engine.kvCacheDtype", advice.since)]
    if out2.announce is not None:
        out2.announce()
    assert "AutotuneAdvice" not in [e[3] for e in kube.events]

    # Healthy again: the advice goes (an empty list, so the status patch removes it).
    calm = snap(t=T0 + 120, seqs=32, kv_cache_element_bytes=4)
    out3 = autotune_step(ctx(spec_body(seqs=32), status={"autotune": r2.dump()}, kube=kube),
                         reader_factory=FakeReader([calm]), now=T0 + 120)
    assert out3.status().advice == [] and out3.report["advice"] == []


def test_a_deployment_already_on_fp8_gets_no_advice():
    body = spec_body()
    body["engine"]["kvCacheDtype"] = "fp8"
    out = autotune_step(ctx(body, kube=FakeKube()), reader_factory=FakeReader([snap(**PREEMPTING,
                                                                                   kv_cache_element_bytes=1)]), now=T0)
    assert out.status().advice == []
