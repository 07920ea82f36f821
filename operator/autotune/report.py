"""What the operator writes under `status.autotune`, built in the API's own models
(kvpilot.operator.api.status, the one schema of that block), and one row of the live demo table.

    report = build_report(decision, history, snapshot, capacity)
    patch["status"]["autotune"] = report.dump()

`history_from_status` reads the block back, so the autotuner's memory survives an
operator restart (the status is the only place it lives)."""

from __future__ import annotations

import datetime as _dt

from pydantic.alias_generators import to_camel, to_snake

from ..api.status import AdviceStatus, AutotuneStatus, DecisionStatus, ModelMemory, SnapshotStatus
from .advice import Advice
from .capacity import CapacityPlan
from .decision import Action, Decision, Diagnosis
from .history import History, HistoryEntry, Observation
from .planner import fit
from .signals import MetricsSnapshot



def rfc3339(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: str) -> float:
    return _dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=_dt.timezone.utc).timestamp()


def decision_status(d: Decision, applied: bool | None = None, verified: bool | None = None) -> DecisionStatus:
    return DecisionStatus(
        time=rfc3339(d.time), diagnosis=d.diagnosis.value, action=d.action.value,
        change={to_camel(k): [int(a), int(b)] for k, (a, b) in d.change.items()},  # as the spec spells it
        reason=d.reason, applied=applied, target=d.target,
        baseline=None if d.baseline is None else round(d.baseline, 4),
        throughput_baseline=None if d.throughput_baseline is None else round(d.throughput_baseline, 2),
        good_per_replica=None if d.good_per_replica is None else round(d.good_per_replica, 4),
        finished_per_replica=None if d.finished_per_replica is None else round(d.finished_per_replica, 4),
        verified=verified,
    )


def snapshot_status(s: MetricsSnapshot) -> SnapshotStatus:
    def r(v):
        return None if v is None else round(float(v), 4)

    return SnapshotStatus(
        time=rfc3339(s.time), window_seconds=s.window_s,
        kv_usage_mean=r(s.kv_usage_mean), kv_usage_max=r(s.kv_usage_max),
        preemptions_per_second=r(s.preemptions_per_s), queue_time_p95_seconds=r(s.queue_time_p95_s),
        ttft_p95_seconds=r(s.ttft_p95_s), tpot_p95_seconds=r(s.tpot_p95_s),
        generation_tokens_per_second=r(s.generation_tokens_per_s),
        num_waiting=r(s.num_waiting), num_running=r(s.num_running), running_min=r(s.running_min),
        running_busiest_pod=r(s.running_busiest_pod),
        request_rate_per_second=r(s.request_rate_per_s), request_latency_mean_seconds=r(s.request_latency_mean_s),
        request_len_p99=r(s.request_len_p99),
        prefix_hit_rate=r(s.prefix_hit_rate), length_refusals_per_second=r(s.length_refusals_per_s),
        spec_acceptance_rate=r(s.spec_acceptance_rate), spec_mean_accepted_len=r(s.spec_mean_accepted_len),
        spec_drafts_per_second=r(s.spec_drafts_per_s), num_speculative_tokens=r(s.num_speculative_tokens),
        missing=list(s.missing), stale=list(s.stale),
    )


def build_report(decision: Decision, history: History, snapshot: MetricsSnapshot | None = None,
                 capacity: CapacityPlan | None = None, advice: list[AdviceStatus] | None = None) -> AutotuneStatus:
    """status.autotune after this interval; `history` should already include `decision`
    (History.record), so the last decision's entry carries its applied flag."""
    entry = next((e for e in reversed(history.entries) if e.decision is decision), None)
    last = decision_status(decision, applied=entry.applied if entry else None,
                           verified=entry.verified if entry else None)
    return AutotuneStatus(
        diagnosis=decision.diagnosis.value,
        last_decision=last,
        history=[decision_status(e.decision, e.applied, e.verified) for e in history.entries],
        recent_diagnoses=[d.value for _, d in history.diagnoses],
        capacity=capacity.to_status() if capacity else None,
        snapshot=snapshot_status(snapshot) if snapshot else None,
        model=(_model_status(history, decision.time)
               if (history.observations or history.plans or history.rates or history.pods or history.good_rates
                   or history.startup_s is not None) else None),
        advice=advice or [],
    )


def advice_status(advice: list[Advice], before: list[AdviceStatus], now: float) -> list[AdviceStatus]:
    """This interval's advice, each keeping the `since` of the same advice last interval."""
    since = {(a.setting, a.value): a.since for a in before}
    return [AdviceStatus(setting=a.setting, value=a.value, reason=a.reason,
                         since=since.get((a.setting, a.value)) or rfc3339(now)) for a in advice]


def _model_status(history: History, now: float) -> ModelMemory:
    model = fit(history, now)
    return ModelMemory(
        fit=str(model) if model else None,
        observations=[[o.time, round(o.running, 3), round(o.prompt_tokens_per_s, 1), round(o.tpot_s, 6)]
                      for o in history.observations],
        plans=[[t, n] for t, n in history.plans],
        rates=[[t, round(r, 4), n] for t, r, n in history.rates],
        good_rates=[[t, round(g, 4), round(f, 4), n] for t, g, f, n in history.good_rates],
        grown=[*history.grown, history.pods] if history.grown else ([history.pods] if history.pods else []),
        startup_s=None if history.startup_s is None else round(min(history.startup_s, 86400.0), 1))


def history_from_status(status: dict | None, limit: int = 20) -> History:
    """Rebuild History from a stored status.autotune block (empty when there is none).
    The diagnoses trail keeps no times, so it is spaced one second apart before the
    newest change; only its order matters to the policy."""
    if not status:
        return History(limit=limit)
    report = AutotuneStatus.model_validate(status)
    entries = []
    for item in report.history:
        if item.time is None or item.diagnosis is None or item.action is None:
            continue  # not written by the autotuner (the schema leaves them optional)
        d = Decision(
            time=_parse_time(item.time), diagnosis=Diagnosis(item.diagnosis), action=Action(item.action),
            reason=item.reason, change={to_snake(k): (v[0], v[1]) for k, v in item.change.items()},
            target=item.target, baseline=item.baseline, throughput_baseline=item.throughput_baseline,
            good_per_replica=item.good_per_replica,
            finished_per_replica=item.finished_per_replica,
        )
        entries.append(HistoryEntry(d, applied=bool(item.applied),
                                    checked=item.verified is not None, verified=item.verified))
    last = report.last_decision
    end = _parse_time(last.time) if last is not None and last.time is not None else 0.0
    n = len(report.recent_diagnoses)
    diagnoses = tuple((end - (n - 1 - i), Diagnosis(d)) for i, d in enumerate(report.recent_diagnoses))
    observations, plans, rates, good_rates, grown, pods, startup = (), (), (), (), None, 0, None
    if report.model is not None:
        observations = tuple(Observation(*row[:4]) for row in report.model.observations if len(row) >= 4)
        plans = tuple((row[0], int(row[1])) for row in report.model.plans if len(row) >= 2)
        rates = tuple((row[0], row[1], int(row[2])) for row in report.model.rates if len(row) >= 3)
        good_rates = tuple((row[0], row[1], row[2], int(row[3])) for row in report.model.good_rates if len(row) >= 4)
        g = report.model.grown
        grown, pods = ((g[0], int(g[1])), int(g[2])) if len(g) == 3 else (None, int(g[0]) if g else 0)
        startup = report.model.startup_s
    return History(entries=tuple(entries)[-limit:], diagnoses=diagnoses[-limit:], limit=limit,
                   observations=observations, plans=plans, rates=rates, good_rates=good_rates, grown=grown,
                   pods=pods, startup_s=startup)


TABLE_HEADER = (f"{'time':<8} {'KV%':>5} {'preempt/s':>9} {'queue p95':>9} {'TTFT p95':>8} {'TPOT p95':>8} "
                f"{'tok/s':>6} {'seqs':>5} {'len':>6} {'repl':>4}  {'diagnosis':<15} decision")


def format_table_row(time: float, snapshot: MetricsSnapshot | None, max_num_seqs: int, max_model_len: int,
                     replicas: int, decision: Decision | None) -> str:
    """One line of the live demo table (see TABLE_HEADER); unknown numbers print as '-'."""
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    s = snapshot
    clock = _dt.datetime.fromtimestamp(time, _dt.timezone.utc).strftime("%H:%M:%S")
    kv = None if s is None or s.kv_usage_mean is None else 100 * s.kv_usage_mean
    tpot_ms = None if s is None or s.tpot_p95_s is None else 1000 * s.tpot_p95_s
    ttft = None if s is None else s.ttft_p95_s
    if decision is None:
        diag, what = "-", "-"
    else:
        diag = decision.diagnosis.value
        what = (decision.action.value + " " + ", ".join(f"{k} {a}->{b}" for k, (a, b) in decision.change.items())
                if decision.change else "hold")
    return (f"{clock:<8} {num(kv, '5.1f'):>5} {num(s and s.preemptions_per_s, '9.2f'):>9} "
            f"{num(s and s.queue_time_p95_s, '8.2f') + ('s' if s and s.queue_time_p95_s is not None else ''):>9} "
            f"{num(ttft, '.2f') + ('s' if ttft is not None else ''):>8} "
            f"{num(tpot_ms, '.0f') + ('ms' if tpot_ms is not None else ''):>8} "
            f"{num(s and s.generation_tokens_per_s, '.0f'):>6} "
            f"{max_num_seqs:>5} {max_model_len:>6} {replicas:>4}  {diag:<15} {what}")
