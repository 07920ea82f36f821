"""`make autotune-bench`: the headline benchmark. One fixed, seeded mixed-length
workload on the local cluster (real operator, real Prometheus, real engine pods on
the tiny model), judged by one service-level objective: TTFT <= 5 s and TPOT <= 50 ms
(a 20 tokens/s stream per user). It runs three ways:

  default      the settings a user gets by leaving them out of the spec
               (maxNumSeqs 64, maxModelLen 2048, maxNumBatchedTokens 2048)
  best static  the best of a max_num_seqs x max_model_len sweep (shorter runs;
               live settings change through the ConfigMap without restarting pods)
  Auto         autotune.mode Auto from the first second, started from the defaults and
               told the same TPOT objective (autotune.objectives.tpot); its ramp-up and
               convergence are part of the run

Prints a table (goodput, throughput, TTFT/TPOT p95, preemptions), the ratios
autotuned/default and autotuned/best-static, the time Auto took to converge and
Auto's goodput after it converged; writes results/autotune-bench.json and
results/autotune-bench-timeline.png.

    python e2e/autotune_bench.py [--out results] [--cluster-dir .cluster]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvsession as ks  # noqa: E402
from kvsession import log  # noqa: E402
from timeline import (Change, Sample, Slo, changes_to_json, convergence_time, format_table,  # noqa: E402
                      goodput, goodput_after, observed_changes, percentile, samples_to_json,
                      write_timeline_png)

ROOT = ks.ROOT
NAME = "tiny"
# 32k tokens of the tiny model (4 KiB per token): room for every request in flight, so the
# cache never binds and the setting that matters is how wide each decode step is.
KV_CACHE = "128Mi"
DEFAULTS = {"maxNumSeqs": 64, "maxModelLen": 2048}  # operator/api/spec.py EngineSpec defaults
SWEEP_SEQS = (8, 16, 24, 32)
SWEEP_LEN = (768, 2048)  # >= 624, the workload's longest request (512 + 112)
SLO = Slo(ttft_ms=5000, tpot_ms=50)
# 32 users sending back to back (a closed loop: no run can fall ever further behind),
# prompts much longer than answers; the same seeded requests in every run.
WORKLOAD = ks.Workload(num_requests=1200, rate=float("inf"), max_concurrency=32, seed=7,
                       input_min=32, input_max=512, output_min=16, output_max=112)
SWEEP_WORKLOAD = replace(WORKLOAD, num_requests=160)  # the first 160 of the same requests
AUTOTUNE = {"mode": "Auto", "interval": "10s", "window": "20s", "cooldown": "20s",
            "maxNumSeqs": {"min": 2, "max": 64}, "maxModelLen": {"min": 768, "max": 2048},
            "objectives": {"tpot": f"{SLO.tpot_ms:g}ms"}}
AUTOSCALING = {"minReplicas": 1, "maxReplicas": 1}  # one pod, like the static runs: a contest of settings only


def summarize_run(outcomes: list[ks.RequestOutcome], duration_s: float, preemptions: float | None,
                  settings: str) -> dict:
    ok = [o for o in outcomes if o.error is None]
    return {
        "settings": settings, "duration_s": duration_s, "sent": len(outcomes), "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "goodput": goodput([(o.ttft, o.tpot) for o in outcomes], duration_s, SLO),
        "throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_tok_s": sum(o.output_tokens for o in ok) / duration_s if duration_s > 0 else 0.0,
        "ttft_p95_s": percentile([o.ttft for o in ok], 95),
        "tpot_p95_s": percentile([o.tpot for o in ok if o.tpot is not None], 95),
        "preemptions": preemptions,
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
    }


def settings_label(seqs, length, replicas=None) -> str:
    return f"seqs={seqs} len={length}" + (f" x{replicas}" if replicas else "")


class Bench:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.ns = f"bench-{uuid.uuid4().hex[:6]}"
        self.cluster = self.kube = None
        self.started_cluster = False
        self.results: dict = {"workload": asdict(WORKLOAD), "sweep_workload": asdict(SWEEP_WORKLOAD),
                              "slo": asdict(SLO), "kv_cache": KV_CACHE, "defaults": DEFAULTS,
                              "autotune": AUTOTUNE, "autoscaling": AUTOSCALING, "runs": {}, "sweep": []}

    # --- one run ------------------------------------------------------------------
    def run_load(self, name: str, workload: ks.Workload, label: str, before=None) -> dict:
        """Sends `workload` to the deployment's pods and summarizes it; `before(driver)`
        runs just before the load starts."""
        urls_fn = lambda: ks.pod_urls(self.kube, self.ns, name)  # noqa: E731  (preemptions: per pod)
        urls = urls_fn()
        targets = ks.load_targets(self.kube, self.ns, name, direct=self.args.direct)
        p0 = ks.preemptions_total(urls)
        last = [0.0]

        def progress(done, total):
            now = time.monotonic()
            if now - last[0] >= 10 or done == total:
                last[0] = now
                log(f"  {label}: {done}/{total} requests done")
        log(f"  {label}: sending {workload.describe()}")
        d = ks.LoadDriver(targets, name, workload, progress=progress)
        if before is not None:
            before(d)
        d.start()
        d.join()
        if d.error:
            raise d.error
        duration = d.finished - d.started
        urls = set(urls) | set(urls_fn())
        p1 = ks.preemptions_total(sorted(urls))
        preempt = sum(p1.values()) - sum(p0.get(u, 0.0) for u in p1)
        r = summarize_run(d.results, duration, preempt, label)
        r["outcomes"] = [[o.sent_at, o.ttft, o.tpot] for o in d.results]
        r["load_started_monotonic"] = d.started
        log(f"  {label}: goodput {r['goodput']:.3f}/s, {r['throughput']:.3f} req/s, TTFT p95 "
            f"{r['ttft_p95_s'] or 0:.2f}s, TPOT p95 {1000 * (r['tpot_p95_s'] or 0):.0f}ms, "
            f"{preempt:.0f} preemptions, {duration:.0f}s")
        return r

    def static_deployment(self) -> None:
        eng = {**DEFAULTS, "maxNumBatchedTokens": 2048, "kvCacheMemory": KV_CACHE}
        m = ks.llmd_manifest(self.ns, NAME, eng, {"mode": "Off", "prometheus": {"url": self.cluster.prometheus_url}},
                             autoscaling={"minReplicas": 1, "maxReplicas": 1})
        ks.deploy(self.cluster, self.kube, m)

    # --- the three ways -------------------------------------------------------------
    def run(self) -> int:
        t_all = time.monotonic()
        self.cluster, self.started_cluster = ks.open_cluster(Path(self.args.cluster_dir))
        self.kube = self.cluster.kube()
        ks.install_operator(self.cluster, values=None if self.args.direct else {"gateway.enabled": "true"})
        log(f"workload: {WORKLOAD.describe()}; KV cache {KV_CACHE} per pod; objective {SLO.describe()}")
        self.static_deployment()

        # (a) defaults
        log("[1/3] the defaults (what a user gets without setting anything)")
        ks.set_live(self.cluster, self.kube, self.ns, NAME, DEFAULTS["maxNumSeqs"], DEFAULTS["maxModelLen"])
        self.results["runs"]["default"] = self.run_load(NAME, WORKLOAD, settings_label(64, 2048))
        self.save()

        # (b) sweep, then the best static setting on the full workload
        points = [(s, n) for s in SWEEP_SEQS for n in SWEEP_LEN]
        log(f"[2/3] sweeping max_num_seqs x max_model_len over {len(points)} points "
            f"({SWEEP_WORKLOAD.num_requests} requests each)")
        for i, (seqs, length) in enumerate(points, 1):
            ks.set_live(self.cluster, self.kube, self.ns, NAME, seqs, length)
            r = self.run_load(NAME, SWEEP_WORKLOAD, f"sweep {i}/{len(points)} " + settings_label(seqs, length))
            self.results["sweep"].append({"max_num_seqs": seqs, "max_model_len": length, **r})
            self.save()
        best = max(self.results["sweep"], key=lambda r: (r["goodput"], r["throughput"]))
        log(f"best static: {settings_label(best['max_num_seqs'], best['max_model_len'])} "
            f"(sweep goodput {best['goodput']:.3f}/s)")
        ks.set_live(self.cluster, self.kube, self.ns, NAME, best["max_num_seqs"], best["max_model_len"])
        self.results["runs"]["best_static"] = self.run_load(
            NAME, WORKLOAD, settings_label(best["max_num_seqs"], best["max_model_len"]))
        self.save()
        self.cluster.kubectl("delete", "llmd", NAME, "-n", self.ns, "--wait=true", "--timeout=60s", check=False)

        # (c) Auto from the defaults, on a fresh LLMDeployment (no history)
        log("[3/3] Auto, started from the defaults")
        auto = "tiny-auto"
        eng = {**DEFAULTS, "maxNumBatchedTokens": 2048, "kvCacheMemory": KV_CACHE}
        m = ks.llmd_manifest(self.ns, auto, eng, {**AUTOTUNE, "prometheus": {"url": self.cluster.prometheus_url}},
                             autoscaling=AUTOSCALING)
        ks.deploy(self.cluster, self.kube, m)
        header_every = [0]

        def row(s, at):
            if header_every[0] % 12 == 0:
                log(f"  {'t':>5} {'KV%':>5} {'pre/s':>6} {'q p95':>6} {'tpot':>5} {'seqs':>4} {'len':>5} "
                    f"{'rep':>3} diagnosis")
            header_every[0] += 1
            f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
            log(f"  {s.t:5.0f} {f(s.kv_pct, '5.1f')} {f(s.preempt_per_s, '6.2f')} {f(s.queue_p95_s, '6.2f')} "
                f"{f(s.tpot_p95_ms, '5.0f')} {f(s.max_num_seqs, '4d')} {f(s.max_model_len, '5d')} "
                f"{f(s.replicas, '3d')} {s.diagnosis or '-'}")
        mon = ks.Monitor(self.cluster, self.kube, self.ns, auto, every_s=5, window_s=15, on_row=row)
        try:
            r = self.run_load(auto, WORKLOAD, "Auto (from defaults)", before=lambda d: mon.start())
        finally:
            mon.stop()
        r["monitor_offset_s"] = r["load_started_monotonic"] - mon.t0
        final = mon.status.get("effective") or {}
        r["settings"] = "Auto -> " + settings_label(final.get("maxNumSeqs"), final.get("maxModelLen"),
                                                    final.get("replicas"))
        changes = sorted(mon.changes + observed_changes(mon.samples, mon.changes), key=lambda c: c.t)
        r["converge_s"] = convergence_time(changes, run_start=r["monitor_offset_s"])
        r["changes"] = changes_to_json(changes)
        r["diagnosis_final"] = (mon.status.get("autotune") or {}).get("diagnosis")
        r["autotune_message"] = (mon.status.get("autotune") or {}).get("message")
        self.results["runs"]["auto"] = r
        self.results["timeline"] = samples_to_json(mon.samples)
        self.results["total_s"] = time.monotonic() - t_all
        self.save()
        report(self.results, self.out)
        return 0

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "autotune-bench.json").write_text(json.dumps(self.results, indent=1, default=str))

    def cleanup(self) -> None:
        if self.cluster is None:
            return
        if self.started_cluster:
            log("stopping the local cluster this benchmark started")
            self.cluster.stop()
        else:
            self.cluster.kubectl("delete", "namespace", self.ns, "--wait=false", check=False)


def report(results: dict, out: Path) -> str:
    """Writes the timeline PNG and the table file from a results dict (a fresh run's,
    or one read back with --replot) and prints the summary; returns the table."""
    runs = results["runs"]
    auto = runs["auto"]
    samples = [Sample(**s) for s in results.get("timeline", [])]
    changes = [Change(**c) for c in auto.get("changes", [])]
    changes = sorted(changes + observed_changes(samples, changes), key=lambda c: c.t)
    offset = auto.get("monitor_offset_s", 0.0)
    auto["converge_s"] = convergence_time(changes, run_start=offset)
    w = results["workload"]
    slo = Slo(**results["slo"])
    png = write_timeline_png(samples, changes, out / "autotune-bench-timeline.png",
                             title=f"Auto from the defaults ({ks.Workload(**w).describe()})",
                             phases=[(offset, "load starts")], objectives={"tpot_p95_ms": slo.tpot_ms})
    table = format_table([("default", runs["default"]), ("best static", runs["best_static"]), ("Auto", auto)],
                         slo, auto_key="Auto", default_key="default", best_key="best static",
                         converge_s=auto.get("converge_s"))
    sweep = "\n".join(f"  sweep {settings_label(p['max_num_seqs'], p['max_model_len'])}: goodput "
                      f"{p['goodput']:.3f}/s, {p['throughput']:.3f} req/s, {p['preemptions']:.0f} preemptions"
                      for p in results["sweep"])
    after = goodput_after(auto, auto.get("converge_s"), slo)
    if after is not None:
        table += (f"\nAuto after it converged (requests sent from {auto['converge_s']:.0f}s on): goodput "
                  f"{after:.3f}/s = x{after / runs['best_static']['goodput']:.2f} best static"
                  if runs["best_static"]["goodput"] else "")
    final = (f"Auto's final state: {auto['settings'].removeprefix('Auto -> ')}, diagnosis "
             f"{auto.get('diagnosis_final')}" + (f" ({auto['autotune_message']})" if auto.get("autotune_message") else ""))
    text = (f"workload: {ks.Workload(**w).describe()}\nKV cache {results['kv_cache']} per pod; sweep runs: "
            f"the first {results['sweep_workload']['num_requests']} of the same requests\n{sweep}\n\n{table}\n{final}")
    print("\n" + "=" * 100 + "\n" + text + "\n" + "=" * 100)
    print(f"timeline: {png}\nraw results: {out / 'autotune-bench.json'}"
          + (f"\ntotal time {results['total_s'] / 60:.1f} min" if results.get("total_s") else ""))
    (out / "autotune-bench-table.txt").write_text(text + "\n")
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--cluster-dir", default=os.environ.get("CLUSTER_DIR", str(ROOT / ".cluster")))
    ap.add_argument("--direct", action="store_true",
                    help="send the load straight to the engine pods instead of through kvpilot's gateway")
    ap.add_argument("--replot", action="store_true",
                    help="only rewrite the PNG and the table from OUT/autotune-bench.json")
    args = ap.parse_args()
    if args.replot:
        report(json.loads((Path(args.out) / "autotune-bench.json").read_text()), Path(args.out))
        return 0
    import logging
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return ks.run_to_exit_code(Bench(args), "autotune-bench")


if __name__ == "__main__":
    sys.exit(main())
