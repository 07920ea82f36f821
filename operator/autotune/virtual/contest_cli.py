"""`kvpilot autotune contest`: every contender on one named scenario in virtual time
(contest.py), one table with goodput per GPU-hour and the ratios, a per-phase table, and a
timeline PNG per contender. Figures are from the simulated accelerator."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

SIM_LABEL = "SIMULATED accelerator"


def _fmt(v, spec: str, unit: str = "") -> str:
    return "-" if v is None else format(v, spec) + unit


def print_table(results: list[dict]) -> None:
    print(f"{'contender':<36} {'good/GPU-h':>10} {'good':>7} {'of':>7} {'failed':>6} {'GPU-h':>6} "
          f"{'TTFT p95':>9} {'TPOT p95':>9} {'preempt':>7}")
    for r in results:
        o = r["overall"]
        print(f"{r['name']:<36} {o['goodput_per_gpu_hour']:>10.0f} {o['good']:>7} {o['requests']:>7} "
              f"{o['failed']:>6} {o['gpu_hours']:>6.2f} {_fmt(o['ttft_p95_s'], '.2f', 's'):>9} "
              f"{_fmt(o['tpot_p95_s'] and 1000 * o['tpot_p95_s'], '.0f', 'ms'):>9} {o['preemptions']:>7}")


def print_phases(results: list[dict]) -> None:
    names = [p["name"] for p in results[0]["phases"]]
    print(f"{'goodput per GPU-hour by phase':<36} " + " ".join(f"{n:>9}" for n in names))
    for r in results:
        print(f"{r['name']:<36} " + " ".join(f"{p['goodput_per_gpu_hour']:>9.0f}" for p in r["phases"]))
    print(f"{'GPUs in use (mean)':<36}")
    for r in results:
        print(f"{r['name']:<36} " + " ".join(f"{p['gpus_mean']:>9.2f}" for p in r["phases"]))


def ratios(results: list[dict]) -> dict:
    """Auto against the best static point, the best replica-only autoscaler and the defaults."""
    by_kind: dict[str, list[dict]] = {}
    for r in results:
        by_kind.setdefault(r["kind"], []).append(r)
    auto = by_kind.get("auto", [None])[0]
    if auto is None:
        return {}

    def best(rows):
        return max(rows, key=lambda r: r["overall"]["goodput_per_gpu_hour"]) if rows else None

    out = {}
    statics = [r for r in by_kind.get("static", []) if r["name"] != "defaults"]
    defaults = next((r for r in results if r["name"] == "defaults"), None)
    rivals = [r for k in ("keda", "wva", "hpa-kv") for r in by_kind.get(k, [])]
    a = auto["overall"]["goodput_per_gpu_hour"]
    for key, ref in (("best_static", best(statics)), ("best_replica_only", best(rivals)), ("defaults", defaults)):
        if ref is not None:
            g = ref["overall"]["goodput_per_gpu_hour"]
            out[key] = {"name": ref["name"], "goodput_per_gpu_hour": g, "ratio": a / g if g else math.inf}
    if defaults is not None:
        out["worst_phase_vs_defaults"] = min(
            (ap["goodput_per_gpu_hour"] / dp["goodput_per_gpu_hour"] if dp["goodput_per_gpu_hour"] else math.inf,
             ap["name"]) for ap, dp in zip(auto["phases"], defaults["phases"]))
    return out


def plot_timeline(r: dict, scen, path: Path, bin_s: float = 30.0, clock: str = "virtual time") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = r["end"]
    bins = max(1, math.ceil(end / bin_s))
    xs = [(k + 0.5) * bin_s / 60 for k in range(bins)]

    def per_s(times):
        counts = [0] * bins
        for t in times:
            counts[min(int(t // bin_s), bins - 1)] += 1
        return [c / bin_s for c in counts]

    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    ax = axes[0]
    ax.plot(xs, per_s(r["arrivals"]), label="arrivals/s", color="tab:gray")
    ax.plot(xs, per_s(r["good_finishes"]), label="good (met SLO)/s", color="tab:green")
    ax.set_ylabel("requests/s")
    ax.legend(loc="upper right")
    ax = axes[1]
    tl = r["gpu_timeline"] + [(end, r["gpu_timeline"][-1][1])]
    ax.step([t / 60 for t, _ in tl], [n for _, n in tl], where="post", color="tab:blue")
    ax.set_ylabel("GPUs held")
    ax = axes[2]
    st = r["settings_timeline"]
    if st:
        ax.step([t / 60 for t, *_ in st], [s for _, s, _, _ in st], where="post", label="max_num_seqs")
        ax.set_yscale("log", base=2)
    else:
        ax.axhline(r["settings"][0], label="max_num_seqs (fixed)")
    ax.set_ylabel("max_num_seqs")
    ax.legend(loc="upper right")
    for d in r["decisions"]:
        for a in axes:
            a.axvline(d["time"] / 60, color="tab:red", alpha=0.25, lw=0.8)
    for name, start, _ in scen.boundaries():
        for a in axes:
            a.axvline(start / 60, color="black", alpha=0.4, ls="--", lw=0.8)
        axes[0].text(start / 60, axes[0].get_ylim()[1] * 0.92, f" {name}", fontsize=8)
    axes[-1].set_xlabel(f"minutes ({clock})")
    o = r["overall"]
    fig.suptitle(f"{SIM_LABEL}: {scen.accelerator}, {scen.model}, scenario {scen.name} - {r['name']}: "
                 f"{o['goodput_per_gpu_hour']:.0f} good req per GPU-hour (red: decisions)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{name} takes comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{name} takes comma-separated positive integers, got {text!r}")
    return values


def _cmd(args: argparse.Namespace) -> int:
    import logging

    from kvpilot.engine.fleet.scenarios import scenario

    # Hundreds of simulated replicas start and stop: their start-up lines would bury the table.
    logging.getLogger("kvpilot.engine").setLevel(logging.WARNING)

    from .contest import Contender, headline_contenders, run_many, sweep_grid

    scen = scenario(args.scenario)
    if args.workers is not None and not 1 <= args.workers <= 64:
        raise ValueError(f"workers must be in [1, 64], got {args.workers}")
    if args.time_scale != 1.0:
        scen = scen.scaled(args.time_scale)
    control_scale = 1.0
    if args.scale_controls:
        if not 0 < args.time_scale <= 1:
            raise ValueError(f"--scale-controls needs a --time-scale in (0, 1], got {args.time_scale}")
        control_scale = args.time_scale
    contenders = headline_contenders(scen)
    if args.rules_only:
        contenders.append(Contender("auto-rules", scen.max_num_seqs, scen.max_model_len, scen.replicas,
                                    label="kvpilot Auto (rules only)"))
    if args.sweep:
        contenders += sweep_grid(scen, _ints(args.sweep_seqs, "sweep_seqs"), _ints(args.sweep_lens, "sweep_lens"))
    print(f"{SIM_LABEL}: {scen.accelerator} serving {scen.model}, scenario {scen.name} "
          f"({scen.duration / 60:.0f} min of virtual time), {len(contenders)} runs", flush=True)
    done = [0]

    def progress(r: dict) -> None:
        done[0] += 1
        print(f"  [{done[0]}/{len(contenders)}] {r['name']}: {r['overall']['goodput_per_gpu_hour']:.0f} "
              f"good/GPU-h ({r['wall_s']:.0f}s wall)", file=sys.stderr, flush=True)

    results = run_many(scen, contenders, workers=args.workers, on_done=progress, control_scale=control_scale)
    print()
    headline = [r for r in results if r["kind"] != "static" or r["name"] == "defaults"]
    statics = sorted((r for r in results if r["kind"] == "static" and r["name"] != "defaults"),
                     key=lambda r: -r["overall"]["goodput_per_gpu_hour"])
    shown = headline + statics[:1]
    if statics:
        shown[-1] = {**statics[0], "name": f"best static: {statics[0]['name'].removeprefix('static ')}"}
    print_table(shown)
    print()
    print_phases(shown)
    summary = ratios(results)
    print()
    for key in ("best_static", "best_replica_only", "defaults"):
        if key in summary:
            s = summary[key]
            print(f"Auto / {key.replace('_', ' ')} ({s['name']}): x{s['ratio']:.2f}")
    if "worst_phase_vs_defaults" in summary:
        ratio, phase = summary["worst_phase_vs_defaults"]
        print(f"Auto's worst phase against the defaults: {phase} x{ratio:.2f}")
    auto = next((r for r in results if r["kind"] == "auto"), None)
    if auto and auto.get("settle"):
        print("Auto's settle time after each phase change: " + ", ".join(
            f"{s['phase']} {s['settle_s']:.0f}s ({s['windows']:.1f} windows, {s['changes']} changes)"
            for s in auto["settle"]))
    print(f"({SIM_LABEL}: modelled figures, not measured on hardware)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slim = [{k: v for k, v in r.items() if k not in ("arrivals", "good_finishes")} for r in results]
    (out / f"contest-{scen.name}.json").write_text(json.dumps(
        {"simulated": True, "scenario": scen.name, "time_scale": args.time_scale, "control_scale": control_scale,
         "ratios": summary,
         "results": slim}, indent=1))
    for r in shown:
        slug = "".join(ch if ch.isalnum() else "-" for ch in r["name"].lower()).strip("-")
        plot_timeline(r, scen, out / f"contest-{scen.name}-{slug}.png")
    print(f"wrote {out}/contest-{scen.name}.json and a timeline PNG per contender")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("contest", help="kvpilot Auto against static settings and replica-only autoscalers, "
                                       "in virtual time on a simulated accelerator")
    p.add_argument("--scenario", default="day", help="day, preemption, long-max-model-len, scheduler-bound")
    p.add_argument("--time-scale", type=float, default=1.0, help="every phase this many times as long")
    p.add_argument("--scale-controls", action="store_true",
                   help="with --time-scale below 1: every control loop (scrapes, HPA sync and stabilization, "
                        "Auto's interval, window and cooldown) and pod start-up compressed as much")
    p.add_argument("--sweep", action="store_true", help="also sweep static max_num_seqs x max_model_len x replicas")
    p.add_argument("--sweep-seqs", default="64,128,256,512")
    p.add_argument("--sweep-lens", default="16384,32768")
    p.add_argument("--rules-only", action="store_true", help="also run Auto without the deployment model")
    p.add_argument("--workers", type=int, default=None, help="processes (default: one per CPU)")
    p.add_argument("--out", default="results")
    p.set_defaults(func=_cmd)
