"""The operator's autotune hook: `autotune_step(ctx)` runs one autotuner interval for one
LLMDeployment (the contract is AutotuneContext/AutotuneOutcome in operator/reconcile.py).

The reconcile calls it on every pass (from a worker thread, so blocking Prometheus and
API calls do not stall kopf's event loop); it decides at most once per
spec.autotune.interval, measured from the time of the last decision in status:

1. read a MetricsSnapshot from spec.autotune.prometheus.url over spec.autotune.window;
2. plan capacity from the pods' own kvpilot:kv_cache_bytes and
   kvpilot:kv_cache_bytes_per_token (any model, no config.json needed);
3. rebuild the History from status.autotune (the only place it lives) and `decide`;
4. Auto mode applies the decision: max_num_seqs / max_model_len / num_speculative_tokens through the proposal
   (the reconcile writes them to the tuning ConfigMap), replicas through the
   LLMDeployment's scale subresource, as an HPA would (and not at all when an HPA
   targets it). Each applied change is an Event (AutotuneChange / AutotuneRevert, the
   decision's reason as message) and a count in kvpilot_operator_autotune_decisions_total,
   both made through the outcome's `announce`, which reconcile runs after the status that
   records the change is written;
5. the MetricsAvailable condition says whether that read gave data, and if not why
   (PrometheusUnreachable, BadResponse, NoData), with the URL and the error;
6. with spec.autotune.sharedPrefix set, a low prefix-cache hit rate raises the
   PrefixCacheIneffective condition and a Warning Event (diagnose only);
7. settings that need a restart (an fp8 KV cache while the cache's size binds: advice.py)
   go into status.autotune.advice, with a Normal Event (AutotuneAdvice) when one first
   appears; they are never applied;
8. the TuningApplied condition says whether the pods report (kvpilot:max_num_seqs,
   kvpilot:max_model_len, kvpilot:num_speculative_tokens) the settings in effect. A short disagreement is the tuning
   ConfigMap still propagating; one that outlasts TUNING_GRACE_S (or two windows) is
   PodsDisagree with a Warning Event: the engine refused a value, e.g. a max_model_len
   longer than its KV cache holds.
"""
from __future__ import annotations

import datetime as _dt
import functools
import logging
import re
import time
from typing import Any, Callable, Protocol

from ..runtime import metrics
from ..manifests.objects import INSTANCE_LABEL, chunk_bounds
from .context import AutotuneContext, AutotuneOutcome
from ..api.spec import DEFAULT_PROMETHEUS_URL, LLMDeploymentSpec
from ..names import GROUP, KIND, VERSION
from ..api.validation import spec_tokens_bounds
from ..api.status import AutotuneStatus, Condition, Effective
from .advice import prefix_cache_warning, restart_advice
from .capacity import CapacityPlan, plan_capacity
from .decision import Action, Bounds, Decision, Diagnosis, Range, Settings, Thresholds
from .prometheus.fleet import FleetReader, FleetReaders
from .forecast import record as record_rate
from .payoff import record_good
from .history import History
from .planner import observation
from .policy import decide
from .prometheus.condition import METRICS_CONDITION, metrics_condition
from .prometheus.reader import PrometheusReader
from .prometheus.client import connect
from .report import AdviceStatus, advice_status, build_report, history_from_status
from .scale_to_zero import last_to_zero, quiet, scale_to_zero
from .signals import MetricsSnapshot

log = logging.getLogger(__name__)

# Prometheus's labelmap turns the pod label serving.kvpilot.dev/llmdeployment into this.
SERIES_LABEL = re.sub(r"[^a-zA-Z0-9_]", "_", INSTANCE_LABEL)
PREFIX_CONDITION = "PrefixCacheIneffective"
TUNING_CONDITION = "TuningApplied"
TUNING_GRACE_S = 180.0  # kubelet syncs a changed ConfigMap volume within about a minute
_DURATION = re.compile(r"([0-9]+)(ms|s|m|h)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


class Reader(Protocol):
    def snapshot(self, namespace: str, name: str, window_s: float) -> MetricsSnapshot: ...


ReaderFactory = Callable[[str], Reader]


def parse_duration(text: str) -> float:
    """Seconds from a spec duration ("30s", "2m", "1m30s", "500ms")."""
    parts = _DURATION.findall(text or "")
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return sum(int(n) * _UNIT_S[u] for n, u in parts)


def _parse_time(text: str) -> float:
    return _dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=_dt.timezone.utc).timestamp()


def default_reader(url: str) -> Reader:
    """One deployment's own queries (event-triggered passes)."""
    return PrometheusReader(connect(url, "deployment"), label=SERIES_LABEL)


def fleet_reader(url: str) -> Reader:
    """One grouped read of every deployment behind `url` (a resync pass)."""
    return FleetReader(connect(url, "fleet"), label=SERIES_LABEL)


def autotune_step_for_pass() -> Callable[[AutotuneContext], AutotuneOutcome]:
    """The hook for one resync pass: autotune_step reading through FleetReaders that the
    pass's deployments share (one set of queries per Prometheus URL and window)."""
    readers = FleetReaders(fleet_reader)
    return functools.partial(autotune_step, reader_factory=readers.reader_for)


def thresholds_for(spec: LLMDeploymentSpec) -> Thresholds:
    tpot, ttft = spec.autotune.objectives.tpot, spec.autotune.objectives.ttft
    season = spec.autotune.season
    return Thresholds(cooldown_s=parse_duration(spec.autotune.cooldown),
                      tpot_objective_s=parse_duration(tpot) if tpot else None,
                      ttft_objective_s=parse_duration(ttft) if ttft else None,
                      attainment=spec.autotune.objectives.attainment,
                      planner=spec.autotune.controller == "Model",
                      season_s=parse_duration(season) if season else None)


def bounds_for(spec: LLMDeploymentSpec) -> Bounds:
    a = spec.autotune
    spec_tokens = spec_tokens_bounds(spec)
    return Bounds(max_num_seqs=Range(a.max_num_seqs.min, a.max_num_seqs.max),
                  max_model_len=Range(a.max_model_len.min, a.max_model_len.max),
                  replicas=Range(spec.autoscaling.min_replicas, spec.autoscaling.max_replicas),
                  num_speculative_tokens=Range(*spec_tokens) if spec_tokens is not None else None,
                  max_num_batched_tokens=Range(*chunk_bounds(spec)))


def last_decision_time(prev: AutotuneStatus | None) -> float | None:
    if prev is None or prev.last_decision is None or not prev.last_decision.time:
        return None
    try:
        return _parse_time(prev.last_decision.time)
    except ValueError:
        return None


def history_of(prev: AutotuneStatus | None) -> History:
    """The autotuner's memory, from the previous status.autotune (empty if it holds none)."""
    if prev is None or prev.last_decision is None or prev.diagnosis is None:
        return History()
    try:
        return history_from_status(prev.dump())
    except (ValueError, KeyError):  # a report from an older autotuner: start afresh
        log.warning("status.autotune unreadable; starting with an empty history")
        return History()


def capacity_plan(snap: MetricsSnapshot | None, current: Settings) -> CapacityPlan | None:
    """The KV formula run backwards on the pods' own KV sizing gauges."""
    if snap is None or not snap.kv_cache_bytes or not snap.kv_bytes_per_token:
        return None
    return plan_capacity(seq_len=snap.request_len_p99 or current.max_model_len,
                         max_num_seqs=current.max_num_seqs, block_size=current.block_size,
                         kv_cache_memory=int(snap.kv_cache_bytes), bytes_per_token=int(snap.kv_bytes_per_token),
                         kv_element_bytes=int(snap.kv_cache_element_bytes) if snap.kv_cache_element_bytes else None,
                         weight_bytes=int(snap.weight_bytes) if snap.weight_bytes else None)


def _to_zero(reader, spec: LLMDeploymentSpec, owner, current: Settings, snap: MetricsSnapshot, history: History,
             now: float) -> Decision | None:
    """The scale-to-zero decision when minReplicas is 0 and this window was quiet (only then
    is the longer idle period read); None otherwise, or when that read fails."""
    if spec.autoscaling.min_replicas != 0 or current.replicas < 1 or not quiet(snap) or not hasattr(reader, "idle"):
        return None
    after_s = parse_duration(spec.autoscaling.scale_to_zero_after)
    try:
        idle = reader.idle(owner.namespace, owner.name, after_s)
    except Exception as e:  # no verdict on idleness: the usual rules decide
        log.warning("autotune %s/%s: reading the idle period failed: %s", owner.namespace, owner.name, e)
        return None
    return scale_to_zero(idle, current, bounds_for(spec), after_s, now, last_to_zero(history))


def autotune_step(ctx: AutotuneContext, *, reader_factory: ReaderFactory | None = None,
                  now: float | None = None) -> AutotuneOutcome:
    spec, at, owner, kube = ctx.spec, ctx.spec.autotune, ctx.owner, ctx.kube
    now = time.time() if now is None else now
    prev = ctx.status.autotune
    last = last_decision_time(prev)
    if last is not None and now - last < parse_duration(at.interval):
        return AutotuneOutcome(report=prev, proposed=None, conditions=None)  # not due: hold as is

    current = Settings(
        max_num_seqs=ctx.effective.max_num_seqs, max_model_len=ctx.effective.max_model_len,
        replicas=ctx.effective.replicas if ctx.effective.replicas is not None else spec.replicas,
        block_size=spec.engine.block_size,
        max_num_batched_tokens=ctx.effective.max_num_batched_tokens or spec.engine.max_num_batched_tokens,
        hpa_owns_scale=_hpa_owns_scale(kube, owner.namespace, owner.name),
        num_speculative_tokens=ctx.effective.num_speculative_tokens)
    thresholds = thresholds_for(spec)
    history = history_of(prev)

    snap: MetricsSnapshot | None = None
    read_error: Exception | None = None
    try:
        reader = (reader_factory or default_reader)((at.prometheus.url or DEFAULT_PROMETHEUS_URL))
        snap = reader.snapshot(owner.namespace, owner.name, parse_duration(at.window))
    except Exception as e:  # Prometheus down, refusing or answering garbage: no data, never a guess
        read_error = e
        log.warning("autotune %s/%s: reading Prometheus failed: %s", owner.namespace, owner.name, e)
        decision = Decision(now, Diagnosis.NO_DATA, Action.HOLD,
                            f"no decision: reading Prometheus at {(at.prometheus.url or DEFAULT_PROMETHEUS_URL)} failed: {e}")
    plan = capacity_plan(snap, current)
    if snap is not None:
        history = record_rate(history.observe(observation(snap, current.replicas)), snap, current.replicas,
                              thresholds).saw_pods(now, len(snap.pods))
        history = record_good(history, snap, current.replicas, thresholds)
        decision = (_to_zero(reader, spec, owner, current, snap, history, now)
                    or decide(snap, current, bounds_for(spec), history, now, capacity=plan, thresholds=thresholds))

    auto = at.mode == "Auto"
    applied = auto and decision.changes_something
    replicas = current.replicas
    if applied and "replicas" in decision.change:
        new = decision.change["replicas"][1]
        try:
            if kube is None:
                raise RuntimeError("no API client")
            kube.patch_scale(owner.namespace, owner.name, new)
            replicas = new
        except Exception as e:
            log.warning("autotune %s/%s: scaling to %s failed: %s", owner.namespace, owner.name, new, e)
            applied = False
    history = history.record(decision, applied)
    before = _previous_advice(prev)
    advice = advice_status(restart_advice(decision.diagnosis, snap, plan, kv_cache_dtype=spec.engine.kv_cache_dtype,
                                          simulated=spec.engine.simulate is not None, thresholds=thresholds),
                           before, now)
    report = build_report(decision, history, snap, plan, advice).dump()
    metrics.AUTOTUNE_DIAGNOSES.labels(decision.diagnosis.value).inc()

    proposed = None
    if decision.changes_something and (applied or not auto):
        values = {k: b for k, (_, b) in decision.change.items()}
        proposed = Effective(max_num_seqs=values.get("max_num_seqs", current.max_num_seqs),
                             max_model_len=values.get("max_model_len", current.max_model_len),
                             replicas=replicas if auto else values.get("replicas", current.replicas),
                             num_speculative_tokens=values.get("num_speculative_tokens",
                                                               current.num_speculative_tokens),
                             max_num_batched_tokens=values.get("max_num_batched_tokens",
                                                               ctx.effective.max_num_batched_tokens))
    # The Events and counter wait for the status write (reconcile runs `announce` after it).
    announce = functools.partial(_announce_change, kube, owner, decision) if applied else None
    fresh = [a for a in advice if (a.setting, a.value) not in {(b.setting, b.value) for b in before}]
    if fresh:
        announce = functools.partial(_announce_advice, kube, owner, fresh, announce)

    conditions = _keep_previous(ctx, {PREFIX_CONDITION: _prefix_conditions(ctx, snap, thresholds),
                                      TUNING_CONDITION: _tuning_condition(ctx, snap, current, now),
                                      METRICS_CONDITION: [metrics_condition((at.prometheus.url or DEFAULT_PROMETHEUS_URL), snap, read_error)]})
    return AutotuneOutcome(report=report, proposed=proposed, conditions=conditions, announce=announce)


# --- side effects -------------------------------------------------------------------------

def involved_object(owner) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": owner.name,
            "namespace": owner.namespace, "uid": owner.uid}


def _event(kube: Any, owner, type_: str, reason: str, message: str) -> None:
    if kube is None:
        return
    try:
        kube.create_event(involved_object(owner), type_, reason, message)
    except Exception as e:  # an Event is a courtesy; it must not undo the decision
        log.warning("autotune %s/%s: posting Event %s failed: %s", owner.namespace, owner.name, reason, e)


def _announce_change(kube: Any, owner, decision: Decision) -> None:
    reason = "AutotuneRevert" if decision.action is Action.REVERT else "AutotuneChange"
    change = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in decision.change.items())
    _event(kube, owner, "Normal", reason, f"{change}: {decision.reason}")
    for setting in decision.change:
        metrics.AUTOTUNE_DECISIONS.labels(owner.namespace, owner.name, decision.action.value, setting).inc()
    log.info("autotune %s/%s: %s %s (%s)", owner.namespace, owner.name, decision.action.value, change,
             decision.diagnosis.value)


def _previous_advice(prev: AutotuneStatus | None) -> list[AdviceStatus]:
    if prev is None or not prev.advice:
        return []
    return [AdviceStatus(setting=a.setting, value=a.value, reason=a.reason, since=a.since or "")
            for a in prev.advice]


def _announce_advice(kube: Any, owner, advice: list[AdviceStatus], then: Callable[[], None] | None) -> None:
    """One Event per piece of advice when it first appears (not every interval it holds)."""
    if then is not None:
        then()
    for a in advice:
        _event(kube, owner, "Normal", "AutotuneAdvice", f"set spec.{a.setting}: {a.value} ({a.reason})")
        log.info("autotune %s/%s: advice spec.%s=%s", owner.namespace, owner.name, a.setting, a.value)


def _hpa_owns_scale(kube: Any, namespace: str, name: str) -> bool:
    """True when an HPA targets the LLMDeployment; also when that cannot be checked (leaving
    replicas alone is the safe side)."""
    if kube is None:
        return True
    try:
        return bool(kube.scale_targeted_by_hpa(namespace, name))
    except Exception as e:
        log.warning("autotune %s/%s: listing HPAs failed (%s); leaving replicas alone", namespace, name, e)
        return True


def _prefix_conditions(ctx: AutotuneContext, snap: MetricsSnapshot | None,
                       thresholds: Thresholds) -> list[Condition] | None:
    """PrefixCacheIneffective, only where spec.autotune.sharedPrefix says prompts share a prefix
    (the engine cannot tell); None (keep the previous condition) when there is no data."""
    if not ctx.spec.autotune.shared_prefix:
        return []
    if snap is None or snap.no_data_reason() is not None:
        return None
    warning = prefix_cache_warning(snap, True, thresholds)
    if warning is None:
        return [Condition(type=PREFIX_CONDITION, status="False", reason="PrefixCacheHits",
                          message="prefix-cache hit rate is fine, or too little traffic to judge")]
    before = ctx.status.condition(PREFIX_CONDITION)
    if before is None or before.status != "True":  # one Event per episode, not per interval
        _event(ctx.kube, ctx.owner, "Warning", PREFIX_CONDITION, warning)
        metrics.AUTOTUNE_WARNINGS.labels(PREFIX_CONDITION).inc()
    return [Condition(type=PREFIX_CONDITION, status="True", reason="LowPrefixCacheHitRate", message=warning)]


def _tuning_condition(ctx: AutotuneContext, snap: MetricsSnapshot | None, current: Settings,
                      now: float) -> list[Condition] | None:
    """TuningApplied from the settings the pods report; None (keep the previous one) when
    no pod reports any (no data, or stock vLLM pods without the kvpilot: gauges)."""
    settings = ("max_num_seqs", "max_model_len") + (
        ("num_speculative_tokens",) if current.num_speculative_tokens is not None else ())
    if snap is None or not any(snap.reported(k) for k in settings):
        return None
    expected = ", ".join(f"{k}={getattr(current, k)}" for k in settings)
    differ = [f"{k}={sorted(snap.reported(k))}" for k in settings
              if snap.reported(k) and snap.reported(k) != {getattr(current, k)}]
    if not differ:
        return [Condition(type=TUNING_CONDITION, status="True", reason="PodsReportSettings",
                          message=f"every pod reports {expected}")]
    before = ctx.status.condition(TUNING_CONDITION)
    since = now
    if before is not None and before.status == "False" and before.last_transition_time:
        try:
            since = _parse_time(before.last_transition_time)
        except ValueError:
            pass
    grace = max(TUNING_GRACE_S, 2 * parse_duration(ctx.spec.autotune.window))
    reported = ", ".join(differ)
    if now - since < grace:
        return [Condition(type=TUNING_CONDITION, status="False", reason="Propagating",
                          message=f"pods report {reported} while {expected} is in effect: waiting for the "
                                  f"tuning ConfigMap to reach them")]
    message = (f"pods still report {reported} {now - since:.0f}s after {expected} took effect: the engine "
               f"refuses a tuning file it cannot honour (e.g. max_model_len longer than its KV cache "
               f"holds); see the pod logs")
    if before is None or before.reason != "PodsDisagree":  # one Event per episode
        _event(ctx.kube, ctx.owner, "Warning", "TuningNotApplied", message)
    return [Condition(type=TUNING_CONDITION, status="False", reason="PodsDisagree", message=message)]


def _keep_previous(ctx: AutotuneContext, parts: dict[str, list[Condition] | None]) -> list[Condition]:
    """The autotuner's conditions replace the previous ones as a whole; a part that has
    nothing to say (None) carries its previous condition over unchanged."""
    out: list[Condition] = []
    for kind, part in parts.items():
        if part is None:
            before = ctx.status.condition(kind)
            part = [before] if before is not None else []
        out += part
    return out
