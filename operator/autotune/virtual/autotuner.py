"""The autotuner in virtual time: the operator's own Prometheus reader and pure policy,
driving a simulated fleet (kvpilot.engine.fleet.fleet) instead of pods.

Every scrape of the fleet lands in an in-memory TSDB that answers the reader's PromQL
with Prometheus's semantics (promql_lite), so each decision reads the same signals, over
the same windows, as it would from a real Prometheus; the decision's changes go to the
fleet (live limits, replicas that start after a delay). The controller never sees the
simulator's timing model: only what the pods export."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

from kvpilot.engine.fleet.fleet import Fleet, Scrape
from kvpilot.engine.fleet.trace import TraceRequest

from ..decision import Action, Bounds, Decision, Range, Settings, Thresholds
from ..forecast import record as record_rate
from ..payoff import record_good
from ..history import History
from ..hook import capacity_plan
from ..planner import observation
from ..policy import decide
from ..prometheus.reader import PrometheusReader
from .promql_lite import TSDB
from ..signals import MetricsSnapshot

NAMESPACE, NAME, LABEL = "sim", "sim", "llmdeployment"
CHUNK_MIN = 512  # the smallest chunk budget the autotuner goes to by default


class VirtualPrometheus:
    """A QueryClient over the fleet's scrapes: series labelled as the operator expects
    (namespace, the deployment label, pod)."""

    def __init__(self) -> None:
        self.db = TSDB()
        self._round: tuple[float, set[str]] = (-1.0, set())  # the scrape round being ingested
        self._previous: set[str] = set()

    def ingest(self, scrape: Scrape) -> None:
        pod = f"{NAME}-{scrape.replica}"
        t, pods = self._round
        if scrape.time > t:
            # A new round: the previous one is complete, and a pod it lacked that the one
            # before had is gone; its series go stale now, as Prometheus marks them.
            for gone in self._previous - pods if t >= 0 else ():
                self.db.mark_stale({"pod": gone}, scrape.time)
            self._previous, self._round = pods, (scrape.time, set())
        self._round[1].add(pod)
        base = {"namespace": NAMESPACE, LABEL: NAME, "pod": pod}
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
    snapshot: MetricsSnapshot
    decision: Decision
    applied: bool
    max_num_seqs: int
    max_model_len: int
    replicas: int
    num_speculative_tokens: int | None = None  # None: the fleet does not speculate
    max_num_batched_tokens: int | None = None


LIVE_LIMITS = ("max_num_seqs", "max_model_len", "num_speculative_tokens",
               "max_num_batched_tokens")  # engine.update_limits'


def current_settings(fleet: Fleet) -> Settings:
    engine = fleet.replicas[0].engine
    cfg = fleet.config
    return Settings(max_num_seqs=engine.max_num_seqs, max_model_len=engine.max_model_len,
                    replicas=fleet.num_replicas, block_size=cfg.block_size,
                    max_num_batched_tokens=engine.max_num_batched_tokens,
                    num_speculative_tokens=engine.num_speculative_tokens)


def with_spec_bounds(bounds: Bounds, fleet: Fleet) -> Bounds:
    """The bounds with num_speculative_tokens' default where the fleet speculates and none
    was given: [0, the configured K], as an LLMDeployment's (spec_tokens_bounds)."""
    if bounds.max_num_batched_tokens is None:
        # The chunk budget moves below the one the replicas started with (their ceiling).
        top = fleet.config.max_num_batched_tokens
        bounds = replace(bounds, max_num_batched_tokens=Range(min(CHUNK_MIN, top), top))
    spec = fleet.config.speculative_config
    if bounds.num_speculative_tokens is not None or spec is None:
        return bounds
    return replace(bounds, num_speculative_tokens=Range(0, spec.num_speculative_tokens))


def apply(fleet: Fleet, decision: Decision, startup_s: float) -> None:
    limits = {k: new for k, (_, new) in decision.change.items() if k in LIVE_LIMITS}
    if limits:
        fleet.set_limits(**limits)
    if "replicas" in decision.change:
        old, new = decision.change["replicas"]
        for _ in range(max(new - old, 0)):
            fleet.add_replica(ready_in=startup_s)
        for _ in range(max(old - new, 0)):
            fleet.remove_replica()


class Controller(Protocol):
    """Anything that reads the fleet's Prometheus every `interval_s` and moves its levers:
    kvpilot's autotuner, or a replica-only autoscaler (rivals.py)."""

    name: str
    interval_s: float

    def tick(self, t: float, fleet: Fleet, prom: VirtualPrometheus) -> None: ...


def drive(fleet: Fleet, trace: list[TraceRequest], controller: Controller | None,
          interval_s: float | None = None) -> VirtualPrometheus:
    """Run the trace to completion with `controller` ticking every interval (None: a
    static run that still scrapes, so every contender is judged from the same data)."""
    if not fleet.scrape_interval:
        raise ValueError("the fleet needs a scrape_interval for a controller to read it")
    prom = VirtualPrometheus()
    fleet.on_scrape = prom.ingest
    fleet.submit(trace)
    last_arrival = max((r.arrival for r in trace), default=0.0)
    step = controller.interval_s if controller is not None else (interval_s or 30.0)
    t = step
    while True:
        fleet.run_until(t)
        if controller is not None:
            controller.tick(t, fleet, prom)
        if t >= last_arrival and not any(r.busy for r in fleet.replicas):
            break
        t += step
    fleet.run(())
    return prom


class AutoController:
    """kvpilot's autotuner: the operator's Prometheus reader, capacity plan and pure
    policy, deciding every interval; in Auto mode its changes reach the fleet."""

    name = "Auto"

    def __init__(self, tune: AutotuneSettings, on_interval: Callable[[Interval], None] | None = None) -> None:
        self.tune, self.interval_s, self.on_interval = tune, tune.interval_s, on_interval
        self.history = History()
        self.intervals: list[Interval] = []
        self._reader: PrometheusReader | None = None

    def tick(self, t: float, fleet: Fleet, prom: VirtualPrometheus) -> None:
        if self._reader is None:
            self._reader = PrometheusReader(prom, scrape_interval_s=fleet.scrape_interval, label=LABEL)
        tune = self.tune
        snap = self._reader.snapshot(NAMESPACE, NAME, tune.window_s, at=t)
        current = current_settings(fleet)
        plan = capacity_plan(snap, current)
        self.history = self.history.observe(observation(snap, current.replicas))
        self.history = record_rate(self.history, snap, current.replicas, tune.thresholds).saw_pods(t, len(snap.pods))
        self.history = record_good(self.history, snap, current.replicas, tune.thresholds)
        bounds = with_spec_bounds(tune.bounds, fleet)
        decision = decide(snap, current, bounds, self.history, t, capacity=plan, thresholds=tune.thresholds)
        applied = tune.mode == "Auto" and decision.changes_something
        if applied:
            try:
                apply(fleet, decision, tune.replica_startup_s)
            except ValueError as exc:  # the engine refused a value: as a pod would, keep the old ones
                applied = False
                decision = Decision(t, decision.diagnosis, Action.HOLD, f"{decision.reason}; not applied: {exc}")
        self.history = self.history.record(decision, applied)
        iv = Interval(t, snap, decision, applied, *_effective(fleet),
                      fleet.replicas[0].engine.max_num_batched_tokens)
        self.intervals.append(iv)
        if self.on_interval is not None:
            self.on_interval(iv)


def run_autotuned(fleet: Fleet, trace: list[TraceRequest], tune: AutotuneSettings,
                  on_interval: Callable[[Interval], None] | None = None) -> list[Interval]:
    """Run the trace to completion with the autotuner deciding every interval."""
    auto = AutoController(tune, on_interval)
    drive(fleet, trace, auto)
    return auto.intervals


def _effective(fleet: Fleet) -> tuple[int, int, int, int | None]:
    s = current_settings(fleet)
    return s.max_num_seqs, s.max_model_len, s.replicas, s.num_speculative_tokens


def set_replicas(fleet: Fleet, desired: int, startup_s: float) -> None:
    """Scale the fleet to `desired` replicas, as a Deployment's spec.replicas would: new
    ones start serving after startup_s; removed ones cancel a start or drain."""
    for _ in range(max(desired - fleet.num_replicas, 0)):
        fleet.add_replica(ready_in=startup_s)
    for _ in range(max(fleet.num_replicas - desired, 0)):
        fleet.remove_replica()


def ready_pods(fleet: Fleet) -> set[str]:
    """The pods a Service (and an HPA) would count: serving and not draining."""
    return {f"{NAME}-{r.index}" for r in fleet.replicas if not r.draining}
