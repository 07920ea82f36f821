"""The autotuner contest in virtual time: every contender serves the same seeded scenario
on the same simulated fleet and is judged by the same objectives (scoring.py).

Contenders: the defaults; every point of a static max_num_seqs x max_num_batched_tokens x
max_model_len x replicas grid (contest_grid.py: the best one chosen with hindsight, and the
one chosen on the first part of the trace and judged on the rest); the replica-only
autoscalers (rivals.py) at the defaults; and kvpilot's autotuner in Auto from the
defaults. Runs are independent, so a sweep spreads over processes."""

from __future__ import annotations

import itertools
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from kvpilot.engine.fleet.fleet import Fleet
from kvpilot.engine.fleet.scenarios import Scenario
from kvpilot.engine.fleet.scoring import met_slo, score, window_stats

from . import rivals
from ..decision import Bounds, Range, Thresholds
from .loop_defaults import COOLDOWN_S, INTERVAL_S, REPLICA_STARTUP_S, SCRAPE_S, WINDOW_S
from .rival_dynamo import DynamoPlanner
from .autotuner import AutoController, AutotuneSettings, drive

RIVALS = {"keda": rivals.keda_waiting, "wva": rivals.wva, "hpa-kv": rivals.hpa_kv_usage}


@dataclass(frozen=True)
class Contender:
    """What runs: `kind` static | keda | wva | hpa-kv | auto, from these settings."""

    kind: str
    max_num_seqs: int
    max_model_len: int
    replicas: int = 1
    label: str = ""
    max_num_batched_tokens: int | None = None  # None: the scenario's
    attainment: float | None = None  # Auto's objectives.attainment (kind auto-attainment)

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        mbt = f" mbt={self.max_num_batched_tokens}" if self.max_num_batched_tokens else ""
        return f"static seqs={self.max_num_seqs}{mbt} len={self.max_model_len} x{self.replicas}"


def auto_settings(scen: Scenario, max_replicas: int, planner: bool = True,
                  control_scale: float = 1.0, attainment: float | None = None) -> AutotuneSettings:
    """What the contest's LLMDeployment would say: Auto, the phase's TPOT objective, the
    engine's bounds, and the same replica range the autoscalers get. `control_scale`
    shortens the interval, window, cooldown and pod start-up together (a compressed day)."""
    tpot = next((s.tpot_s for s in scen.slos if s.tpot_s), None)
    ttft = next((s.ttft_s for s in scen.slos if s.ttft_s), None)
    f = control_scale
    return AutotuneSettings(
        mode="Auto", interval_s=INTERVAL_S * f, window_s=WINDOW_S * f,
        bounds=Bounds(Range(1, 1024), Range(1024, 32768), Range(1, max_replicas)),
        # The traffic's period, where the scenario says it repeats (a user's autotune.season):
        # the forecast's lead is a pod's start-up and an interval.
        thresholds=Thresholds(tpot_objective_s=tpot, ttft_objective_s=ttft, attainment=attainment,
                              cooldown_s=COOLDOWN_S * f, planner=planner,
                              season_s=scen.season_s, forecast_lead_s=(REPLICA_STARTUP_S + INTERVAL_S) * f,
                              forecast_settle_s=Thresholds.forecast_settle_s * f),
        replica_startup_s=REPLICA_STARTUP_S * f)


def run_contender(scen: Scenario, c: Contender, max_replicas: int | None = None,
                  control_scale: float = 1.0, split: float | None = None) -> dict:
    """One contender over the whole scenario: its score, timeline and decisions. With a
    `control_scale` below 1 every control loop runs that much faster (scrapes, the HPA's
    sync and scale-down stabilization, KEDA's and WVA's periods, Auto's interval, window
    and cooldown) and pods start that much sooner: the scenario's phases compressed by the
    same factor keep their shape. The accelerator's step times do not change. With
    `split` (0 < F < 1) the result also holds the run judged on the requests that arrived
    in the first F of the trace's time and on the rest, apart ("split")."""
    if not 0 < control_scale <= 1:
        raise ValueError(f"control_scale must be in (0, 1], got {control_scale!r}")
    started = time.perf_counter()
    f = control_scale
    max_replicas = max_replicas or scen.max_replicas
    mbt = {"max_num_batched_tokens": c.max_num_batched_tokens} if c.max_num_batched_tokens else {}
    fleet = Fleet(scen.engine_config(max_num_seqs=c.max_num_seqs, max_model_len=c.max_model_len, **mbt),
                  replicas=c.replicas, scrape_interval=SCRAPE_S * f, keep_scrapes=False,
                  client_timeout=scen.client_timeout_s)
    controller = None
    if c.kind in ("auto", "auto-rules", "auto-attainment"):
        controller = AutoController(auto_settings(scen, max_replicas, planner=c.kind != "auto-rules", control_scale=f,
                                                  attainment=c.attainment))
    elif c.kind in RIVALS:
        behavior = rivals.HpaBehavior(sync_s=15.0 * f, scale_down_stabilization_s=300.0 * f)
        controller = RIVALS[c.kind](max_replicas=max_replicas, startup_s=REPLICA_STARTUP_S * f,
                                    behavior=behavior, **({"period_s": 30.0 * f} if c.kind == "wva" else {}))
    elif c.kind == "dynamo":
        tpot = next((sl.tpot_s for sl in scen.slos if sl.tpot_s), 0.05)
        controller = DynamoPlanner(scen.accelerator, scen.model, tpot, max_replicas=max_replicas,
                                   startup_s=REPLICA_STARTUP_S * f, interval_s=60.0 * f)
    elif c.kind != "static":
        raise ValueError(f"contender kind must be static, auto, auto-rules, auto-attainment, dynamo or one of "
                         f"{sorted(RIVALS)}, got {c.kind!r}")
    trace = scen.trace()
    drive(fleet, trace, controller, interval_s=30.0)
    out = {"name": c.name, "kind": c.kind, "settings": [c.max_num_seqs, c.max_model_len, c.replicas,
                                                        c.max_num_batched_tokens or scen.max_num_batched_tokens],
           **score(fleet, scen), "gpu_timeline": fleet.gpu_timeline, "decisions": [], "settings_timeline": [],
           "wall_s": 0.0}
    if split is not None:
        cut = split * max((r.arrival for r in trace), default=0.0)
        out["split"] = {"at": cut, "first": window_stats(fleet, scen, 0.0, cut),
                        "rest": window_stats(fleet, scen, cut, out["end"])}
    out["arrivals"] = [r.arrival for r in fleet.requests]
    out["good_finishes"] = [r.finished for r in fleet.requests if met_slo(r, scen)]
    out["good_arrivals"] = [r.arrival for r in fleet.requests if met_slo(r, scen)]
    out["queue_times"] = [(r.arrival, r.queue_time if r.queue_time is not None else (r.finished or r.arrival) - r.arrival)
                          for r in fleet.requests]
    out["replica_changes"] = max(0, len(fleet.gpu_timeline) - 1)
    if isinstance(controller, AutoController):
        out["settings_timeline"] = [(iv.time, iv.max_num_seqs, iv.max_model_len, iv.replicas,
                                     iv.max_num_batched_tokens, iv.snapshot.num_waiting)
                                    for iv in controller.intervals]
        out["decisions"] = [{"time": iv.time, "diagnosis": iv.decision.diagnosis.value,
                             "change": {k: list(v) for k, v in iv.decision.change.items()},
                             "reason": iv.decision.reason}
                            for iv in controller.intervals if iv.applied]
        out["settle"] = settle_times(scen, out["decisions"], controller.tune.window_s)
    elif controller is not None:
        out["decisions"] = [{"time": t, "diagnosis": "", "change": {"replicas": [old, new]}, "reason": why}
                            for t, old, new, why in controller.events]
    out["wall_s"] = time.perf_counter() - started
    return out


def settle_times(scen: Scenario, decisions: list[dict], window_s: float) -> list[dict]:
    """After each phase change: when the last change made inside that phase came (its
    settle time), in seconds and in decision windows."""
    out = []
    for name, start, end in scen.boundaries()[1:]:
        inside = [d["time"] for d in decisions if start <= d["time"] < end]
        settle = (max(inside) - start) if inside else 0.0
        out.append({"phase": name, "changes": len(inside), "settle_s": settle, "windows": settle / window_s})
    return out


GRID_SEQS = (4, 8, 16, 32, 64, 128, 256, 512, 1024)  # geometric, what a user would try


def sweep_grid(scen: Scenario, seqs=GRID_SEQS, lens=(16384, 32768), replicas: tuple[int, ...] | None = None,
               mbts: tuple[int, ...] | None = None) -> list[Contender]:
    replicas = replicas or tuple(range(1, scen.max_replicas + 1))
    mbts = mbts or (scen.max_num_batched_tokens,)
    return [Contender("static", s, m, n, max_num_batched_tokens=b if b != scen.max_num_batched_tokens else None)
            for s, b, m, n in itertools.product(seqs, mbts, lens, replicas)]


def headline_contenders(scen: Scenario) -> list[Contender]:
    d = (scen.max_num_seqs, scen.max_model_len)
    return [Contender("static", *d, scen.replicas, label="defaults"),
            Contender("keda", *d, scen.replicas, label="KEDA waiting>5 (production-stack)"),
            Contender("wva", *d, scen.replicas, label="WVA KV>=0.8|queue>=5 (llm-d)"),
            Contender("hpa-kv", *d, scen.replicas, label="HPA KV 0.5 (AIBrix)"),
            Contender("dynamo", *d, scen.replicas, label="Dynamo-style SLA planner"),
            Contender("auto", *d, scen.replicas, label="kvpilot Auto")]


def _run(args) -> dict:
    return run_contender(*args)


def run_many(scen: Scenario, contenders: list[Contender], workers: int | None = None,
             max_replicas: int | None = None, on_done=None, control_scale: float = 1.0,
             split: float | None = None) -> list[dict]:
    """Each contender in its own process (the simulator is single-threaded); results in
    the contenders' order. `on_done(result)` is called as each finishes (progress)."""
    if not contenders:
        return []
    workers = workers or max(1, min(len(contenders), os.cpu_count() or 1))
    jobs = [(scen, c, max_replicas, control_scale, split) for c in contenders]
    results: list[dict | None] = [None] * len(jobs)
    if workers == 1:
        for k, job in enumerate(jobs):
            results[k] = _run(job)
            if on_done:
                on_done(results[k])
        return results  # type: ignore[return-value]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(_run, job): k for k, job in enumerate(jobs)}
        for fut in as_completed(futures):
            results[futures[fut]] = fut.result()
            if on_done:
                on_done(results[futures[fut]])
    return results  # type: ignore[return-value]
