"""The day contest in real time, end to end: the `day` scenario compressed (every phase a
third as long, rates and request shapes unchanged: 15 minutes), replayed open loop on the
local cluster against SIMULATED H100 pods serving Llama-3.1-8B, with the real operator,
the real Prometheus and the real Kubernetes HPA controller. Every control loop is
compressed by the same factor, so the day keeps its shape: Auto's interval, window and
cooldown (5/20/20 s), KEDA's polling (5 s) and its HPA's scale-down stabilization (100 s),
the HPA controller's sync (the local cluster's 5 s) and a new pod's start (~20 s, of
which 15 s simulated model loading). The accelerator's step times are not compressed.
Contenders:

  defaults  the scenario's start settings (max_num_seqs 256, max_model_len 32768), one pod
  keda      the same settings, replicas moved by real KEDA (its Prometheus scaler on
            sum(vllm:num_requests_waiting) > 5, as vLLM production-stack documents) through
            the HPA controller and the LLMDeployment's scale subresource
  auto      kvpilot autotune Auto (controller Model) from the same start, 1-8 replicas

Each is scored exactly as in virtual time (engine/fleet/scoring.py: goodput per GPU-hour,
per phase, a pod holds its GPU from creation until it is gone), and the same compressed
day, with the same compressed control loops, is also run in virtual time
(contest.run_contender's control_scale), so the table shows both and the difference.

    python e2e/day_contest.py [--contenders defaults,keda,auto] [--time-scale 0.3333]
                              [--out results] [--cluster-dir .cluster] [--report-only]

Writes OUT/day-realtime.json (one entry per contender, merged across invocations, so one
contender can be rerun alone), a table, and a timeline PNG per contender."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvsession as ks  # noqa: E402
from kvsession import log  # noqa: E402
from trace_replay import GpuLedger, TraceReplayer  # noqa: E402

from kvpilot.engine.fleet.scenarios import scenario  # noqa: E402
from kvpilot.operator.autotune.virtual.contest import auto_settings  # noqa: E402
from kvpilot.operator.autotune.virtual.contest_cli import SIM_LABEL  # noqa: E402
from kvpilot.engine.fleet.scoring import RecordedRun, met_slo, score  # noqa: E402

ROOT = ks.ROOT
TIME_SCALE = 1 / 3  # 45 minutes of day in 15
POD_START_S = 5.0  # scheduling and starting a simulated pod here, before its model loads
HPA_SYNC_S = 5.0  # the local cluster's --horizontal-pod-autoscaler-sync-period (15 s x 1/3)
DRAIN_S = 600  # the longest a request may still be in flight after the last arrival
CONTENDERS = ("defaults", "keda", "auto")


def load_seconds_for(scale: float) -> float:
    """Simulated model loading that makes a new pod ready as late as the virtual fleet's
    (contest.REPLICA_STARTUP_S, compressed)."""
    from kvpilot.operator.autotune.virtual.contest import REPLICA_STARTUP_S
    return max(0.0, round(REPLICA_STARTUP_S * scale - POD_START_S, 1))


def engine_spec(scen, load_seconds: float) -> dict:
    return {"maxNumSeqs": scen.max_num_seqs, "maxModelLen": scen.max_model_len,
            "maxNumBatchedTokens": scen.max_num_batched_tokens, "gpuMemoryUtilization": 0.9,
            "simulate": {"accelerator": scen.accelerator, "model": scen.model, "loadSeconds": load_seconds}}


def _duration(seconds: float) -> str:
    """A spec duration (whole units only: 5s, or 3750ms)."""
    ms = round(seconds * 1000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def autotune_spec(scen, kind: str, prometheus_url: str, scale: float = 1.0) -> dict:
    """Auto as the virtual contest runs it (contest.auto_settings, with the same
    control_scale); Off for the others."""
    if kind != "auto":
        return {"mode": "Off", "prometheus": {"url": prometheus_url}}
    s = auto_settings(scen, scen.max_replicas, planner=True, control_scale=scale)
    b = s.bounds
    return {"mode": "Auto", "controller": "Model", "interval": _duration(s.interval_s),
            "window": _duration(s.window_s), "cooldown": _duration(s.thresholds.cooldown_s),
            "maxNumSeqs": {"min": b.max_num_seqs.min, "max": b.max_num_seqs.max},
            "maxModelLen": {"min": b.max_model_len.min, "max": b.max_model_len.max},
            "objectives": {"tpot": f"{1000 * s.thresholds.tpot_objective_s:g}ms"},
            "prometheus": {"url": prometheus_url}}


def scaled_object(ns: str, name: str, prometheus_url: str, max_replicas: int, scale: float = 1.0) -> dict:
    """vLLM production-stack's KEDA rule: scale on the queue, 5 waiting requests per replica;
    its polling and its HPA's scale-down stabilization compressed by `scale`."""
    query = f'sum(vllm:num_requests_waiting{{namespace="{ns}",{ks.PROM_LABEL}="{name}"}})'
    behavior = {"scaleDown": {"stabilizationWindowSeconds": round(300 * scale)}}
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"scaleTargetRef": {"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "LLMDeployment",
                                        "name": name},
                     "pollingInterval": max(1, round(15 * scale)), "minReplicaCount": 1,
                     "maxReplicaCount": max_replicas,
                     "advanced": {"horizontalPodAutoscalerConfig": {"behavior": behavior}},
                     "triggers": [{"type": "prometheus", "metadata": {
                         "serverAddress": prometheus_url, "query": query, "threshold": "5"}}]}}


def preemptions_by_phase(prometheus_url: str, ns: str, name: str, wall0: float, bounds) -> list[float | None]:
    """Preemptions in each phase, from Prometheus (pods that scaled away keep their series)."""
    import httpx
    out = []
    for _, start, end in bounds:
        q = (f'sum(increase(vllm:num_preemptions_total{{namespace="{ns}",{ks.PROM_LABEL}="{name}"}}'
             f'[{max(1, round(end - start))}s]))')
        try:
            r = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": q, "time": f"{wall0 + end:.3f}"},
                          timeout=30).json()
            res = r["data"]["result"]
            out.append(round(float(res[0]["value"][1])) if res else 0)
        except (httpx.HTTPError, KeyError, ValueError):
            out.append(None)
    return out


def prompt_vocab(scen) -> tuple[int, int]:
    """Ordinary token ids of the simulated model's tokenizer: what its server accepts. (The
    virtual fleet skips the server and draws from the whole embedding table; the ids do
    not change a step's time, and shared prefixes are shared in both.)"""
    from kvpilot.engine.fleet.fleet import Fleet
    runner = Fleet(scen.engine_config(), replicas=1).replicas[0].engine.runner
    return runner.tokens.low, runner.tokenizer.vocab_size


def run_realtime(cluster, scen, trace, kind: str, vocab: tuple[int, int], scale: float = 1.0,
                 load_seconds: float | None = None, via_gateway: bool = False,
                 wait_for_cleanup: bool = True) -> dict:
    """One contender on the running cluster (the operator installed; KEDA started for
    "keda"): deploy, replay the trace, score it as the simulator would, clean up. `scale`
    compresses the control loops as contest.run_contender's control_scale does.
    `wait_for_cleanup`: return once its namespace is gone (about 30 s here), so the next
    contender starts with every GPU free; a caller that runs no contender after it need not."""
    if load_seconds is None:
        load_seconds = load_seconds_for(scale)
    kube = cluster.kube()
    ns, name = f"day-{kind}-{uuid.uuid4().hex[:4]}", "llama"
    prom = cluster.prometheus_url
    max_replicas = 1 if kind == "defaults" else scen.max_replicas
    m = ks.llmd_manifest(ns, name, engine_spec(scen, load_seconds), autotune_spec(scen, kind, prom, scale),
                         replicas=1, resources={"gpus": 1, "cpu": "100m", "memory": "512Mi"},
                         autoscaling={"minReplicas": 1, "maxReplicas": max_replicas},
                         model={"servedName": name})
    log(f"[{kind}] deploying {ns}/{name}: {scen.accelerator} (SIMULATED) serving {scen.model}, "
        f"max_num_seqs {scen.max_num_seqs}, max_model_len {scen.max_model_len}, "
        f"{load_seconds:g} s simulated model load")
    ks.deploy(cluster, kube, m, timeout=400)
    if kind == "keda":
        cluster.apply(scaled_object(ns, name, prom, max_replicas, scale))
        hpa = f"/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers/keda-hpa-{name}"
        ks.wait_for(lambda: kube.get(hpa, ok404=True), timeout=120, interval=1, what="KEDA to create its HPA")
        log(f"[{kind}] ScaledObject applied; KEDA made HPA keda-hpa-{name}")
    ledger = GpuLedger(cluster.kube(), ns, f"{ks.INSTANCE_LABEL}={name}")
    mon = ks.Monitor(cluster, kube, ns, name, every_s=5, window_s=60)
    targets = ks.load_targets(kube, ns, name, direct=not via_gateway)  # the gateway: installed with it on
    replay = TraceReplayer(targets, name, trace, vocab,
                           progress=lambda msg: log(f"[{kind}] {msg}"), drain_s=DRAIN_S)
    mon.start()
    t0 = time.monotonic() + 1.0
    wall0 = time.time() + 1.0
    ledger.start(t0)
    log(f"[{kind}] replaying {len(trace)} requests over {scen.duration / 60:.1f} min, open loop")
    replay.start(t0)
    try:
        if not replay.join(timeout=scen.duration + DRAIN_S + 120):
            replay.stop()
            replay.join(60)
    finally:
        ledger.stop()
        mon.stop()
    if replay.error:
        raise replay.error
    abandoned = sum(1 for r in replay.requests if (r.error or "").startswith("abandoned"))
    if abandoned:
        log(f"[{kind}] {abandoned} requests were still unanswered {DRAIN_S} s after the last arrival: "
            "counted as failed")
    run = RecordedRun(sorted(replay.requests, key=lambda r: r.index), ledger.timeline)
    if len(run.requests) != len(trace):
        raise RuntimeError(f"the replay recorded {len(run.requests)} of {len(trace)} requests")
    result = {"name": kind, "kind": kind, "settings": [scen.max_num_seqs, scen.max_model_len, 1],
              **score(run, scen), "gpu_timeline": ledger.timeline}
    for ph, n in zip(result["phases"], preemptions_by_phase(prom, ns, name, wall0, scen.boundaries())):
        ph["preemptions"] = n
    result["overall"]["preemptions"] = sum(p["preemptions"] or 0 for p in result["phases"])
    result["arrivals"] = [r.arrival for r in run.requests]
    result["good_finishes"] = [r.finished for r in run.requests if met_slo(r, scen)]
    offset = t0 - mon.t0
    result["settings_timeline"] = [(s.t - offset, s.max_num_seqs, s.max_model_len, s.replicas)
                                   for s in mon.samples if s.max_num_seqs is not None]
    result["decisions"] = [{"time": c.t - offset, "change": c.change, "reason": c.reason} for c in mon.changes]
    late = sorted(replay.late_s)
    result["client_late_p99_s"] = late[int(0.99 * (len(late) - 1))] if late else None
    result["errors"] = sorted({r.error for r in run.requests if r.error})[:5]
    log(f"[{kind}] {result['overall']['goodput_per_gpu_hour']:.0f} good req/GPU-h, "
        f"{result['overall']['failed']} failed, client send lag p99 {result['client_late_p99_s'] or 0:.3f}s")
    cluster.kubectl("delete", "namespace", ns, *(("--wait=true", "--timeout=180s") if wait_for_cleanup
                                                  else ("--wait=false",)), check=False)
    return result


class RealTimeContest:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.scen = scenario("day").scaled(args.time_scale)
        self.trace = self.scen.trace()
        self.cluster = self.kube = None
        self.started_cluster = False
        self.keda = None

    # --- virtual time, the same compressed day --------------------------------------
    def virtual(self, kinds: list[str]) -> dict:
        from kvpilot.operator.autotune.virtual.contest import Contender, run_many
        d = (self.scen.max_num_seqs, self.scen.max_model_len)
        cs = [Contender("static" if k == "defaults" else k, *d, 1, label=k) for k in kinds]
        log(f"virtual time first: the same {self.scen.duration / 60:.0f}-minute day, {len(cs)} contenders")
        runs = run_many(self.scen, cs, workers=min(2, len(cs)), control_scale=self.args.time_scale)
        return {r["name"]: r for r in runs}

    # --- real time ---------------------------------------------------------------------
    def run(self) -> int:
        kinds = self.args.contenders
        results = self.load()
        if not self.args.report_only:
            results.setdefault("virtual", {}).update(self.virtual(kinds))
            self.save(results)
            vocab = prompt_vocab(self.scen)
            self.cluster, self.started_cluster = ks.open_cluster(Path(self.args.cluster_dir))
            self.kube = self.cluster.kube()
            # resync 1 s: decisions on the 5 s interval, not a 5 s tick after it
            ks.install_operator(self.cluster, resync_s=1,
                                values=None if self.args.direct else {"gateway.enabled": "true"})
            if "keda" in kinds:
                from localcluster.keda import start_keda
                self.keda = start_keda(self.cluster)
                if abs(15 * self.args.time_scale - HPA_SYNC_S) > 0.5:
                    log(f"note: the cluster's HPA controller syncs every {HPA_SYNC_S:g} s, not "
                        f"{15 * self.args.time_scale:g} s (15 s compressed): KEDA's replicas move on that clock")
            for k in kinds:
                results.setdefault("realtime", {})[k] = run_realtime(self.cluster, self.scen, self.trace, k, vocab,
                                                                   self.args.time_scale,
                                                                   via_gateway=not self.args.direct)
                self.save(results)
        report(results, self.scen, self.out)
        return 0

    def load(self) -> dict:
        path = self.out / "day-realtime.json"
        if path.exists():
            old = json.loads(path.read_text())
            if old.get("time_scale") == old.get("control_scale") == self.args.time_scale:
                return old  # the same compressed day: keep the contenders not rerun now
        return {"simulated": True, "scenario": "day", "time_scale": self.args.time_scale,
                "control_scale": self.args.time_scale, "load_seconds": load_seconds_for(self.args.time_scale)}

    def save(self, results: dict) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "day-realtime.json").write_text(json.dumps(results, default=str))

    def cleanup(self) -> None:
        if self.keda is not None:
            self.keda.stop()
        if self.cluster is not None and self.started_cluster:
            log("stopping the local cluster this contest started")
            self.cluster.stop()


def report(results: dict, scen, out: Path) -> None:
    from kvpilot.operator.autotune.virtual.contest_cli import plot_timeline, print_phases, print_table
    real, virt = results.get("realtime", {}), results.get("virtual", {})
    kinds = [k for k in CONTENDERS if k in real]
    if not kinds:
        log("no real-time runs to report yet")
        return
    print(f"\n{SIM_LABEL}: day scenario x{results['time_scale']:.3f} ({scen.duration / 60:.0f} min), "
          f"{scen.accelerator} serving {scen.model}; real time on the local cluster vs the same trace in "
          "virtual time")
    rows = []
    for k in kinds:
        rows.append({**real[k], "name": f"{k} (real time)"})
        if k in virt:
            rows.append({**virt[k], "name": f"{k} (virtual time)"})
    print_table(rows)
    print()
    print_phases(rows)
    print()
    print(f"{'contender':<12} {'real':>8} {'virtual':>8} {'real/virtual':>12}   good req per GPU-hour")
    for k in kinds:
        r = real[k]["overall"]["goodput_per_gpu_hour"]
        v = virt.get(k, {}).get("overall", {}).get("goodput_per_gpu_hour")
        print(f"{k:<12} {r:>8.0f} {v or 0:>8.0f} {(r / v if v else float('nan')):>12.2f}")
    for ref in ("defaults", "keda"):
        if "auto" in real and ref in real:
            a, b = (real[x]["overall"]["goodput_per_gpu_hour"] for x in ("auto", ref))
            va, vb = (virt.get(x, {}).get("overall", {}).get("goodput_per_gpu_hour") for x in ("auto", ref))
            if b:
                print(f"Auto / {ref}: x{a / b:.2f} in real time"
                      + (f", x{va / vb:.2f} in virtual time" if va and vb else ""))
    print(f"({SIM_LABEL}: modelled step times, real processes, Prometheus and controllers)")
    for k in kinds:
        r = {**real[k], "name": f"{k}, real time on the local cluster"}
        plot_timeline(r, scen, out / f"day-realtime-{k}.png", clock="real time")
    print(f"wrote {out}/day-realtime.json and day-realtime-<contender>.png")


def _time_scale(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not 0.05 <= v <= 1:  # below 1/20 Auto's interval would be under a second
        raise argparse.ArgumentTypeError(f"--time-scale takes a number in [0.05, 1], got {text!r}")
    return v


def _contenders(text: str) -> list[str]:
    kinds = [k for k in text.split(",") if k]
    bad = [k for k in kinds if k not in CONTENDERS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"--contenders takes a comma-separated subset of {','.join(CONTENDERS)}")
    return kinds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contenders", type=_contenders, default=list(CONTENDERS))
    ap.add_argument("--time-scale", type=_time_scale, default=TIME_SCALE,
                    help="every phase of the day, and every control loop, this many times as long "
                         "(default 1/3: 15 minutes; the HPA controller's sync stays the cluster's 5 s)")
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--cluster-dir", default=os.environ.get("CLUSTER_DIR", str(ROOT / ".cluster")))
    ap.add_argument("--direct", action="store_true",
                    help="send the trace straight to the engine pods instead of through kvpilot's gateway")
    ap.add_argument("--report-only", action="store_true", help="only print and plot OUT/day-realtime.json")
    args = ap.parse_args()
    import logging
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("kvpilot.engine").setLevel(logging.WARNING)
    return ks.run_to_exit_code(RealTimeContest(args), "day contest")


if __name__ == "__main__":
    sys.exit(main())
