"""`kvpilot autotune contest`: every contender on one named scenario in virtual time
(contest.py), one table with goodput per GPU-hour and the ratios, a per-phase table, and a
timeline PNG per contender. Figures are from the simulated accelerator."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from .contest_plot import SIM_LABEL, plot_timeline  # noqa: F401 (e2e/day_contest.py imports them here)

REPLICA_ONLY = ("keda", "wva", "hpa-kv", "dynamo")


def _fmt(v, spec: str, unit: str = "") -> str:
    return "-" if v is None else format(v, spec) + unit


def print_table(results: list[dict], part: str | None = None) -> None:
    """One row per contender; `part` "first"/"rest": judged on that part of a split."""
    print(f"{'contender':<40} {'good/GPU-h':>10} {'SLO':>6} {'good':>7} {'of':>7} {'failed':>6} {'GPU-h':>6} "
          f"{'TTFT p95':>9} {'TPOT p95':>9} {'preempt':>7} {'scale':>5}")
    for r in results:
        o = r["split"][part] if part else r["overall"]
        slo = o["good"] / o["requests"] if o["requests"] else 0.0
        print(f"{r['name'][:40]:<40} {o['goodput_per_gpu_hour']:>10.0f} {100 * slo:>5.1f}% {o['good']:>7} "
              f"{o['requests']:>7} {o['failed']:>6} {o['gpu_hours']:>6.2f} {_fmt(o['ttft_p95_s'], '.2f', 's'):>9} "
              f"{_fmt(o['tpot_p95_s'] and 1000 * o['tpot_p95_s'], '.0f', 'ms'):>9} {o['preemptions']:>7} "
              f"{r.get('replica_changes', 0):>5}")


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
    rivals = [r for k in REPLICA_ONLY for r in by_kind.get(k, [])]
    a = auto["overall"]["goodput_per_gpu_hour"]
    for key, ref in (("best_static", best(statics)), ("best_replica_only", best(rivals)), ("defaults", defaults)):
        if ref is not None:
            g = ref["overall"]["goodput_per_gpu_hour"]
            out[key] = {"name": ref["name"], "goodput_per_gpu_hour": g, "ratio": a / g if g else math.inf}
    from .contest_grid import chosen_on_first  # imports the whole contest: only when one ran

    chosen = chosen_on_first(statics)
    if chosen is not None and "split" in auto:
        g, ar = chosen["split"]["rest"]["goodput_per_gpu_hour"], auto["split"]["rest"]["goodput_per_gpu_hour"]
        out["static_chosen_on_first"] = {"name": chosen["name"], "goodput_per_gpu_hour": g,
                                         "auto_goodput_per_gpu_hour": ar, "ratio": ar / g if g else math.inf}
    if defaults is not None and auto["phases"]:
        out["worst_phase_vs_defaults"] = min(
            (ap["goodput_per_gpu_hour"] / dp["goodput_per_gpu_hour"] if dp["goodput_per_gpu_hour"] else math.inf,
             ap["name"]) for ap, dp in zip(auto["phases"], defaults["phases"]))
    return out


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{name} takes comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{name} takes comma-separated positive integers, got {text!r}")
    return values


def build_scenario(args: argparse.Namespace):
    """The named scenario, or the --trace replayed on the day's accelerator, model and
    starting settings (with the SLO and replica range given); (scenario, trace notes)."""
    from kvpilot.engine.fleet.scenarios import Slo, from_trace, scenario

    if args.trace is None:
        scen = scenario(args.scenario)
        notes: list[str] = []
    else:
        from kvpilot.engine.fleet.cli import load_trace_from_args
        from kvpilot.engine.sim.shapes import resolve_model_shape

        base = scenario(args.scenario)
        ctx = resolve_model_shape(base.model).max_position_embeddings
        loaded = load_trace_from_args(args, ctx)
        s = loaded.summary()
        notes = [f"trace {s['source']}: {s['requests']} requests over {s['duration_s']:.0f} s "
                 f"({s['mean_rate_per_s']:.2f}/s)"] + loaded.notes
        name = Path(args.trace).stem + (f"-x{args.trace_rate_scale:g}" if args.trace_rate_scale != 1 else "")
        settings = {k: v for k, v in (("accelerator", args.accelerator), ("model", args.model),
                                      ("max_num_seqs", args.max_num_seqs), ("max_model_len", args.max_model_len),
                                      ("max_num_batched_tokens", args.max_num_batched_tokens),
                                      ("replicas", args.replicas)) if v is not None}
        scen = from_trace(name, loaded.requests, slo=Slo(ttft_s=args.ttft, tpot_s=args.tpot), base=base, **settings)
    if args.max_replicas is not None:
        if not 1 <= args.max_replicas <= 64:
            raise ValueError(f"max_replicas must be in [1, 64], got {args.max_replicas}")
        from dataclasses import replace

        scen = replace(scen, max_replicas=args.max_replicas)
    if args.days != 1:
        scen = scen.repeated(args.days)
    if args.season is not None:
        if not args.season > 0:
            raise ValueError(f"season must be positive seconds, got {args.season}")
        from dataclasses import replace

        scen = replace(scen, season_s=args.season)
    if args.client_timeout is not None:
        if not args.client_timeout > 0:
            raise ValueError(f"client_timeout must be positive seconds, got {args.client_timeout}")
        from dataclasses import replace

        scen = replace(scen, client_timeout_s=args.client_timeout)
    return scen, notes


def _cmd(args: argparse.Namespace) -> int:
    import logging

    # Hundreds of simulated replicas start and stop: their start-up lines would bury the table.
    logging.getLogger("kvpilot.engine").setLevel(logging.WARNING)

    from .contest import Contender, headline_contenders, run_many, sweep_grid
    from .contest_grid import run_grid

    if args.workers is not None and not 1 <= args.workers <= 64:
        raise ValueError(f"workers must be in [1, 64], got {args.workers}")
    if args.split is not None and not 0 < args.split < 1:
        raise ValueError(f"split must be in (0, 1), got {args.split}")
    scen, notes = build_scenario(args)
    if args.time_scale != 1.0:
        scen = scen.scaled(args.time_scale)
    control_scale = 1.0
    if args.scale_controls:
        if not 0 < args.time_scale <= 1:
            raise ValueError(f"--scale-controls needs a --time-scale in (0, 1], got {args.time_scale}")
        control_scale = args.time_scale
    contenders = headline_contenders(scen)
    if args.contenders:
        kinds = set(args.contenders.split(","))
        known = {c.kind for c in contenders}
        if not kinds <= known:
            raise ValueError(f"contenders takes a comma-separated subset of {sorted(known)}, got {args.contenders!r}")
        contenders = [c for c in contenders if c.kind in kinds]
    if args.rules_only:
        contenders.append(Contender("auto-rules", scen.max_num_seqs, scen.max_model_len, scen.replicas,
                                    label="kvpilot Auto (rules only)"))
    if args.attainment is not None:
        if not 0 < args.attainment <= 1:
            raise ValueError(f"attainment must be a share in (0, 1], got {args.attainment}")
        contenders.append(Contender("auto-attainment", scen.max_num_seqs, scen.max_model_len, scen.replicas,
                                    label=f"kvpilot Auto (attainment {args.attainment:g})", attainment=args.attainment))
    grid = []
    if args.sweep:
        grid = sweep_grid(scen, _ints(args.sweep_seqs, "sweep_seqs"), _ints(args.sweep_lens, "sweep_lens"),
                          mbts=_ints(args.sweep_mbt, "sweep_mbt"))
    for n in notes:
        print(n)
    timeout = f"clients give up after {scen.client_timeout_s:g} s without a token" if scen.client_timeout_s \
        else "clients never give up"
    print(f"{SIM_LABEL}: {scen.accelerator} serving {scen.model}, {scen.name} "
          f"({scen.duration / 60:.0f} min of virtual time), objective {scen.slos[0]}, {timeout}; "
          f"{len(contenders)} contenders + a static grid of {len(grid)} points", flush=True)
    done = [0]

    def progress(r: dict) -> None:
        done[0] += 1
        print(f"  [{done[0]}] {r['name']}: {r['overall']['goodput_per_gpu_hour']:.0f} "
              f"good/GPU-h ({r['wall_s']:.0f}s wall)", file=sys.stderr, flush=True)

    results = run_many(scen, contenders, workers=args.workers, on_done=progress, control_scale=control_scale,
                       split=args.split)
    pruned = 0
    if grid:
        swept, pruned = run_grid(scen, grid, workers=args.workers, split=args.split, on_done=progress,
                                 control_scale=control_scale)
        results += swept
        print(f"static grid: {len(swept)} points run, {pruned} pruned exactly (could not beat the best)")
    print()
    headline = [r for r in results if r["kind"] != "static" or r["name"] == "defaults"]
    statics = sorted((r for r in results if r["kind"] == "static" and r["name"] != "defaults"),
                     key=lambda r: -r["overall"]["goodput_per_gpu_hour"])
    shown = headline + statics[:1]
    if statics:
        shown[-1] = {**statics[0], "name": f"best static: {statics[0]['name'].removeprefix('static ')}"}
    from .contest_grid import chosen_on_first  # imports the whole contest: only when one ran

    chosen = chosen_on_first(statics)
    print_table(shown)
    print()
    print_phases(shown)
    if args.split is not None:
        rest = headline + ([{**chosen, "name": f"chosen on first: {chosen['name'].removeprefix('static ')}"}]
                           if chosen else [])
        print(f"\njudged on the rest (after the first {args.split:.0%} of the trace):")
        print_table(rest, part="rest")
    summary = ratios(results)
    print()
    for key in ("best_static", "best_replica_only", "defaults", "static_chosen_on_first"):
        if key in summary:
            s = summary[key]
            where = " on the rest" if key == "static_chosen_on_first" else ""
            print(f"Auto / {key.replace('_', ' ')}{where} ({s['name']}): x{s['ratio']:.2f}")
    if "worst_phase_vs_defaults" in summary:
        ratio, phase = summary["worst_phase_vs_defaults"]
        print(f"Auto's worst phase against the defaults: {phase} x{ratio:.2f}")
    auto = next((r for r in results if r["kind"] == "auto"), None)
    if auto and auto.get("settle") and len(scen.phases) > 1:
        print("Auto's settle time after each phase change: " + ", ".join(
            f"{s['phase']} {s['settle_s']:.0f}s ({s['windows']:.1f} windows, {s['changes']} changes)"
            for s in auto["settle"]))
    print(f"({SIM_LABEL}: modelled figures, not measured on hardware)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slim = [{k: v for k, v in r.items() if k not in ("arrivals", "good_finishes", "good_arrivals", "queue_times")}
            for r in results]
    (out / f"contest-{scen.name}.json").write_text(json.dumps(
        {"simulated": True, "scenario": scen.name, "trace_notes": notes, "time_scale": args.time_scale,
         "control_scale": control_scale, "split": args.split, "client_timeout_s": scen.client_timeout_s,
         "grid_pruned": pruned, "ratios": summary, "results": slim}, indent=1))
    if not args.no_plots:
        for r in shown:
            slug = "".join(ch if ch.isalnum() else "-" for ch in r["name"].lower()).strip("-")[:60]
            plot_timeline(r, scen, out / f"contest-{scen.name}-{slug}.png")
    print(f"wrote {out}/contest-{scen.name}.json" + ("" if args.no_plots else " and a timeline PNG per contender"))
    return 0


def add_parser(sub) -> None:
    from kvpilot.engine.fleet.cli import add_trace_options

    p = sub.add_parser("contest", help="kvpilot Auto against static settings and replica-only autoscalers, "
                                       "in virtual time on a simulated accelerator")
    p.add_argument("--scenario", default="day",
                   help="day, preemption, long-max-model-len, scheduler-bound; with --trace, whose accelerator, "
                        "model and starting settings the trace is replayed on (default day's)")
    p.add_argument("--trace", default=None, help="replay this trace file instead of the scenario's traffic")
    add_trace_options(p)
    s = p.add_argument_group("with --trace: where the trace is replayed (default: the scenario's)")
    s.add_argument("--accelerator", default=None, help="a simulated accelerator, e.g. h100-80gb, a100-80gb, l4")
    s.add_argument("--model", default=None, help="a simulated model, e.g. llama-3.1-8b")
    s.add_argument("--max-num-seqs", type=int, default=None, help="your current setting (every contender starts there)")
    s.add_argument("--max-model-len", type=int, default=None, help="your current setting")
    s.add_argument("--max-num-batched-tokens", type=int, default=None, help="your current setting")
    s.add_argument("--replicas", type=int, default=None, help="your current replica count")
    p.add_argument("--ttft", type=float, default=2.0, help="with --trace: the TTFT objective in seconds")
    p.add_argument("--tpot", type=float, default=0.050, help="with --trace: the TPOT objective in seconds")
    p.add_argument("--max-replicas", type=int, default=None, help="what every autoscaler may go up to")
    p.add_argument("--client-timeout", type=float, default=None, metavar="S",
                   help="clients give up (the request fails) after S seconds without a token")
    p.add_argument("--split", type=float, default=None, metavar="F",
                   help="also choose the best static point on the first F of the trace and judge it beside "
                        "Auto on the rest")
    p.add_argument("--days", type=int, default=1, metavar="N",
                   help="the scenario (or trace) N times back to back, its length the season Auto may learn a "
                        "daily pattern over; with --split (N-1)/N the last day is judged apart")
    p.add_argument("--season", type=float, default=None, metavar="S",
                   help="the traffic's period in seconds (a day: 86400) for Auto's forecast (default: none, or "
                        "the day's length with --days)")
    p.add_argument("--time-scale", type=float, default=1.0, help="every phase this many times as long")
    p.add_argument("--scale-controls", action="store_true",
                   help="with --time-scale below 1: every control loop (scrapes, HPA sync and stabilization, "
                        "Auto's interval, window and cooldown) and pod start-up compressed as much")
    p.add_argument("--sweep", action="store_true",
                   help="also sweep static max_num_seqs x max_num_batched_tokens x max_model_len x replicas")
    p.add_argument("--sweep-seqs", default="4,8,16,32,64,128,256,512,1024")
    p.add_argument("--sweep-mbt", default="2048,8192", help="max_num_batched_tokens values of the sweep")
    p.add_argument("--sweep-lens", default="32768")
    p.add_argument("--rules-only", action="store_true", help="also run Auto without the deployment model")
    p.add_argument("--attainment", type=float, default=None, metavar="SHARE",
                   help="also run Auto with spec.autotune.objectives.attainment SHARE (e.g. 0.95): replicas "
                        "bought for attainment past what pays for itself, beside Auto's default")
    p.add_argument("--contenders", default=None, metavar="KINDS",
                   help="run only these of the headline contenders, e.g. auto,dynamo; static: the defaults "
                        "(with --sweep, only the grid beside them) (default: all)")
    p.add_argument("--workers", type=int, default=None, help="processes (default: one per CPU)")
    p.add_argument("--no-plots", action="store_true", help="no timeline PNGs")
    p.add_argument("--out", default="results")
    p.set_defaults(func=_cmd)
