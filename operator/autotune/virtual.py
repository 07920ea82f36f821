"""The autotuner in virtual time: the operator's own Prometheus reader and pure policy,
driving a simulated fleet (kvpilot.engine.sim.fleet) instead of pods.

Every scrape of the fleet lands in an in-memory TSDB that answers the reader's PromQL
with Prometheus's semantics (promql_lite), so each decision reads the same signals, over
the same windows, as it would from a real Prometheus; the decision's changes go to the
fleet (live limits, replicas that start after a delay). The controller never sees the
simulator's timing model: only what the pods export."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kvpilot.engine.sim.fleet import Fleet, Scrape
from kvpilot.engine.sim.trace import TraceRequest

from .decision import Action, Bounds, Decision, Range, Settings, Thresholds
from .history import History
from .hook import capacity_plan
from .policy import decide
from .prometheus import PrometheusReader
from .promql_lite import TSDB
from .signals import Snapshot

NAMESPACE, NAME, LABEL = "sim", "sim", "llmdeployment"


class VirtualPrometheus:
    """A QueryClient over the fleet's scrapes: series labelled as the operator expects
    (namespace, the deployment label, pod)."""

    def __init__(self) -> None:
        self.db = TSDB()

    def ingest(self, scrape: Scrape) -> None:
        base = {"namespace": NAMESPACE, LABEL: NAME, "pod": f"{NAME}-{scrape.replica}"}
        for s in scrape.samples:
            self.db.add(s.name, {**base, **s.labels}, scrape.time, s.value)

    def custom_query(self, query: str, params: dict | None = None) -> list[dict]:
        return self.db.query(query, float(params["time"]))


@dataclass
class AutotuneSettings:
    mode: str = "Auto"  # Auto | Recommend
    interval_s: float = 30.0
    window_s: float = 120.0
    bounds: Bounds = field(default_factory=lambda: Bounds(Range(1, 1024), Range(128, 32768), Range(1, 1)))
    thresholds: Thresholds = field(default_factory=Thresholds)
    replica_startup_s: float = 60.0  # a new GPU pod: scheduled, started, weights loaded

    def __post_init__(self) -> None:
        if self.mode not in ("Auto", "Recommend"):
            raise ValueError(f"mode must be Auto or Recommend, got {self.mode!r}")
        for name in ("interval_s", "window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.replica_startup_s < 0:
            raise ValueError(f"replica_startup_s must be >= 0, got {self.replica_startup_s!r}")


@dataclass
class Interval:
    """One decision interval: what the autotuner saw and what it did."""

    time: float
    snapshot: Snapshot
    decision: Decision
    applied: bool
    max_num_seqs: int
    max_model_len: int
    replicas: int


def current_settings(fleet: Fleet) -> Settings:
    engine = fleet.replicas[0].engine
    cfg = fleet.config
    return Settings(max_num_seqs=engine.max_num_seqs, max_model_len=engine.max_model_len,
                    replicas=fleet.num_replicas, block_size=cfg.block_size,
                    max_num_batched_tokens=cfg.max_num_batched_tokens)


def apply(fleet: Fleet, decision: Decision, startup_s: float) -> None:
    limits = {k: new for k, (_, new) in decision.change.items() if k in ("max_num_seqs", "max_model_len")}
    if limits:
        fleet.set_limits(**limits)
    if "replicas" in decision.change:
        old, new = decision.change["replicas"]
        for _ in range(max(new - old, 0)):
            fleet.add_replica(ready_in=startup_s)
        for _ in range(max(old - new, 0)):
            fleet.remove_replica()


def run_autotuned(fleet: Fleet, trace: list[TraceRequest], tune: AutotuneSettings,
                  on_interval: Callable[[Interval], None] | None = None) -> list[Interval]:
    """Run the trace to completion with the autotuner deciding every interval."""
    if not fleet.scrape_interval:
        raise ValueError("the fleet needs a scrape_interval for the autotuner to read it")
    prom = VirtualPrometheus()
    fleet.on_scrape = prom.ingest
    reader = PrometheusReader(prom, scrape_interval_s=fleet.scrape_interval, label=LABEL)
    history = History()
    intervals: list[Interval] = []
    fleet.submit(trace)
    last_arrival = max((r.arrival for r in trace), default=0.0)
    t = tune.interval_s
    while True:
        fleet.run_until(t)
        snap = reader.snapshot(NAMESPACE, NAME, tune.window_s, at=t)
        current = current_settings(fleet)
        plan = capacity_plan(snap, current)
        decision = decide(snap, current, tune.bounds, history, t, capacity=plan, thresholds=tune.thresholds)
        applied = tune.mode == "Auto" and decision.changes_something
        if applied:
            try:
                apply(fleet, decision, tune.replica_startup_s)
            except ValueError as exc:  # the engine refused a value: as a pod would, keep the old ones
                applied = False
                decision = Decision(t, decision.diagnosis, Action.HOLD, f"{decision.reason}; not applied: {exc}")
        history = history.record(decision, applied)
        iv = Interval(t, snap, decision, applied, *_effective(fleet))
        intervals.append(iv)
        if on_interval is not None:
            on_interval(iv)
        if t >= last_arrival and not any(r.busy for r in fleet.replicas):
            break
        t += tune.interval_s
    fleet.run(())
    return intervals


def _effective(fleet: Fleet) -> tuple[int, int, int]:
    s = current_settings(fleet)
    return s.max_num_seqs, s.max_model_len, s.replicas
