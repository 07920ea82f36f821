"""num_speculative_tokens through the operator: the hook reads the bounds and the K in
effect, Auto turns K down through the tuning ConfigMap and status.effective, the history kept
in status verifies the change a window later and reverts it when TPOT got worse; Recommend
only reports it; TuningApplied includes K."""
from __future__ import annotations

import functools
import json

from kvpilot.operator.autotune.hook import autotune_step
from kvpilot.operator.autotune.signals import PodSettings, MetricsSnapshot
from kvpilot.operator.manifests.objects import Owner
from kvpilot.operator.autotune.context import AutotuneContext
from kvpilot.operator.reconcile import parse_spec, reconcile
from kvpilot.operator.api.status import Effective, LLMDeploymentStatus
from test_autotune_hook import FakeKube as HookFakeKube

T0 = 1_800_000_000.0
OWNER = Owner("tiny", "demo", "u")


class FakeKube(HookFakeKube):
    def tuning(self) -> dict:
        return json.loads([m for m, _ in self.applied if m["kind"] == "ConfigMap"][-1]["data"]["tuning.json"])


def spec_body(mode="Auto") -> dict:
    return {"model": {"source": "builtin:tiny"},
            "engine": {"maxNumSeqs": 128, "maxModelLen": 512, "maxNumBatchedTokens": 4096, "kvCacheMemory": "2Mi",
                       "speculative": {"method": "ngram", "numSpeculativeTokens": 4}},
            "autotune": {"mode": mode, "interval": "5s", "window": "15s", "cooldown": "10s",
                         "prometheus": {"url": "http://prom:9090"}, "maxNumSeqs": {"min": 4, "max": 128},
                         "maxModelLen": {"min": 128, "max": 2048}}}


def snap(t=T0, k=4, **kw) -> MetricsSnapshot:
    """Healthy but wide: 200 running x (1 + K) rows a step, 1.5 tokens per verification."""
    base = dict(time=t, window_s=15.0, kv_usage_mean=0.40, kv_usage_max=0.55, preemptions_per_s=0.0,
                queue_time_p95_s=0.05, num_waiting=0.0, num_running=200.0, running_min=180.0,
                request_rate_per_s=5.0, tpot_mean_s=0.030, tpot_p95_s=0.040, generation_tokens_per_s=3000.0,
                spec_acceptance_rate=0.125, spec_mean_accepted_len=1.5, spec_drafts_per_s=1000.0,
                num_speculative_tokens=float(k), pods=(PodSettings("tiny-0", 128, 512, k),))
    base.update(kw)
    return MetricsSnapshot(**base)


def test_auto_turns_k_off_then_reverts_it_when_tpot_got_worse():
    kube = FakeKube()
    body = {"metadata": {"name": "tiny", "namespace": "demo", "uid": "u", "generation": 1},
            "spec": spec_body(), "status": {}}
    snaps = {"s": snap()}

    class Reader:
        def __call__(self, url):
            return self

        def snapshot(self, ns, name, w):
            return snaps["s"]

    hook = functools.partial(autotune_step, reader_factory=Reader())

    def run(now):
        result = reconcile(kube, body, lambda c: hook(c, now=now))
        body["status"] = result.status.dump()
        return result.status

    st = run(T0)
    d = st.autotune.last_decision
    assert d.change == {"numSpeculativeTokens": [4, 0]} and d.applied is True and d.target == "tpot_mean_s"
    assert "(off: no K pays at this batch)" in d.reason
    assert st.effective.num_speculative_tokens == 0 and body["status"]["effective"]["numSpeculativeTokens"] == 0
    assert kube.tuning() == {"max_num_seqs": 128, "max_model_len": 512, "num_speculative_tokens": 0}
    assert body["spec"]["engine"]["speculative"]["numSpeculativeTokens"] == 4  # never written back
    assert [e[3] for e in kube.events] == ["AutotuneChange"]
    off = dict(k=0, spec_acceptance_rate=None, spec_mean_accepted_len=None, spec_drafts_per_s=0.0)
    snaps["s"] = snap(t=T0 + 6, **off)
    assert run(T0 + 6).autotune.last_decision.action == "hold"  # verifying
    snaps["s"] = snap(t=T0 + 40, tpot_mean_s=0.045, **off)  # worse without the drafts
    st = run(T0 + 40)
    assert st.autotune.last_decision.action == "revert"
    assert st.autotune.last_decision.change == {"numSpeculativeTokens": [0, 4]}
    assert st.effective.num_speculative_tokens == 4 and kube.tuning()["num_speculative_tokens"] == 4
    assert st.autotune.history[0].verified is False


def test_recommend_reports_k_and_applies_nothing():
    spec = parse_spec({"spec": spec_body("Recommend")})
    eff = Effective(max_num_seqs=128, max_model_len=512, replicas=1, num_speculative_tokens=4)
    out = autotune_step(AutotuneContext(OWNER, spec, LLMDeploymentStatus(), eff, FakeKube()),
                        reader_factory=lambda url: type("R", (), {"snapshot": lambda self, *a: snap()})(), now=T0)
    assert out.proposed.num_speculative_tokens == 0 and out.status().last_decision.applied is False
    assert out.announce is None


def test_tuning_applied_includes_k():
    spec = parse_spec({"spec": spec_body()})
    eff = Effective(max_num_seqs=128, max_model_len=512, replicas=1, num_speculative_tokens=2)
    stale = snap(k=4)
    out = autotune_step(AutotuneContext(OWNER, spec, LLMDeploymentStatus(), eff, FakeKube()),
                        reader_factory=lambda url: type("R", (), {"snapshot": lambda self, *a: stale})(), now=T0)
    (cond,) = [c for c in out.conditions if c.type == "TuningApplied"]
    assert cond.reason == "Propagating" and "num_speculative_tokens=[4]" in cond.message
    assert "waiting for the pods to report num_speculative_tokens=[4] (expected 2)" in \
        out.status().last_decision.reason
