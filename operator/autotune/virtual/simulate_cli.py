"""`kvpilot autotune simulate`: the operator's autotuner deciding, in virtual time, for
simulated replicas (kvpilot.operator.autotune.virtual.autotuner). The same flags as `kvpilot sim
run` for the engine and the workload, plus the autotune settings an LLMDeployment has."""

from __future__ import annotations

import argparse
import time


def _range(text: str, name: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi)
    except ValueError:
        raise ValueError(f"{name} takes MIN:MAX integers, got {text!r}") from None
    if not sep or not 1 <= a <= b:
        raise ValueError(f"{name} takes MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return a, b


def _share(text: str) -> float:
    """--attainment: a share in (0, 1], as spec.autotune.objectives.attainment takes it."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a share in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"takes a share in (0, 1], got {text!r}")
    return value


def _cmd(args: argparse.Namespace) -> int:
    from kvpilot.engine.bench.serve_stats import parse_goodput
    from kvpilot.engine.config.args import engine_config_from_args
    from kvpilot.engine.fleet.cli import trace_from_args, write_run_outputs
    from kvpilot.engine.fleet.fleet import Fleet
    from kvpilot.engine.fleet.report import print_sim_result, summarize

    from ..decision import Bounds, Range, Thresholds
    from ..hook import parse_duration
    from ..report import TABLE_HEADER, format_table_row
    from .autotuner import AutotuneSettings, run_autotuned

    config = engine_config_from_args(args)
    if config.simulate is None:
        raise ValueError("kvpilot autotune simulate needs --simulate ACCELERATOR (and --simulate-model)")
    seqs, length, replicas = (_range(args.max_num_seqs_bounds, "max_num_seqs_bounds"),
                              _range(args.max_model_len_bounds, "max_model_len_bounds"),
                              _range(args.replicas_bounds, "replicas_bounds"))
    thresholds = Thresholds(cooldown_s=parse_duration(args.cooldown),
                            tpot_objective_s=parse_duration(args.tpot_objective) if args.tpot_objective else None,
                            ttft_objective_s=parse_duration(args.ttft_objective) if args.ttft_objective else None,
                            attainment=args.attainment)
    tune = AutotuneSettings(mode=args.mode, interval_s=parse_duration(args.interval),
                            window_s=parse_duration(args.window),
                            bounds=Bounds(Range(*seqs), Range(*length), Range(*replicas)),
                            thresholds=thresholds, replica_startup_s=args.replica_startup)
    fleet = Fleet(config, replicas=args.replicas, router=args.router, scrape_interval=args.scrape_interval,
                  max_concurrency=args.max_concurrency, keep_scrapes=bool(args.plot))
    engine = fleet.replicas[0].engine
    trace = trace_from_args(args, engine.max_model_len, engine.runner.max_position_embeddings)
    if not trace:
        raise ValueError("phase: the phases generate no requests")
    print(f"SIMULATED {config.simulate.accelerator} serving {config.simulate.model}, virtual time; "
          f"autotune {tune.mode}, interval {args.interval}, window {args.window}, cooldown {args.cooldown}")
    print(TABLE_HEADER)

    def show(iv) -> None:
        if args.every_row or iv.decision.changes_something:
            print(format_table_row(iv.time, iv.snapshot, iv.max_num_seqs, iv.max_model_len, iv.replicas,
                                   iv.decision), flush=True)

    started = time.perf_counter()
    intervals = run_autotuned(fleet, trace, tune, on_interval=show)
    wall = time.perf_counter() - started
    result = summarize(fleet, parse_goodput(args.goodput))
    result["wall_s"] = wall
    result["decisions"] = [{"time": iv.time, "diagnosis": iv.decision.diagnosis.value,
                            "action": iv.decision.action.value,
                            "change": {k: list(v) for k, v in iv.decision.change.items()},
                            "applied": iv.applied, "reason": iv.decision.reason} for iv in intervals]
    print()
    print_sim_result(result)
    changes = [d for d in result["decisions"] if d["applied"]]
    print(f"{'Autotuner changes applied:':<40} {len(changes)}")
    print(f"{'Simulated / wall time (s):':<40} {result['duration']:.0f} / {wall:.1f}")
    write_run_outputs(fleet, result, args, f"{config.simulate.accelerator}, {config.simulate.model}, "
                                           f"autotune {tune.mode}: {len(changes)} changes")
    return 0 if result["completed"] else 1


def add_parser(subparsers) -> None:
    from kvpilot.engine.config.args import add_engine_args

    from .loop_defaults import COOLDOWN_S, INTERVAL_S, REPLICA_STARTUP_S, SCRAPE_S, WINDOW_S
    from kvpilot.engine.fleet.cli import add_workload_args

    group = subparsers.add_parser("autotune", help="the autotuner outside Kubernetes")
    sub = group.add_subparsers(dest="autotune_command", required=True)
    p = sub.add_parser("simulate", help="the autotuner deciding for simulated replicas in virtual time")
    add_engine_args(p)
    add_workload_args(p)
    p.add_argument("--replicas", type=int, default=1, help="replicas at the start")
    p.add_argument("--router", default="round-robin", choices=("round-robin", "least-loaded"))
    p.add_argument("--max-concurrency", type=int, default=None, help="closed loop: at most this many in flight")
    p.add_argument("--scrape-interval", type=float, default=SCRAPE_S, help="seconds between scrapes")
    a = p.add_argument_group("autotune (as spec.autotune)")
    a.add_argument("--mode", default="Auto", choices=("Auto", "Recommend"))
    a.add_argument("--interval", default=f"{INTERVAL_S:g}s", help="as the contest's")
    a.add_argument("--window", default=f"{WINDOW_S:g}s", help="as the contest's")
    a.add_argument("--cooldown", default=f"{COOLDOWN_S:g}s", help="as the contest's")
    a.add_argument("--tpot-objective", default=None, help="e.g. 50ms (spec.autotune.objectives.tpot)")
    a.add_argument("--ttft-objective", default=None, help="e.g. 2s (spec.autotune.objectives.ttft)")
    a.add_argument("--attainment", type=_share, default=None, metavar="SHARE",
                   help="e.g. 0.95 (spec.autotune.objectives.attainment)")
    a.add_argument("--max-num-seqs-bounds", default="1:1024", metavar="MIN:MAX")
    a.add_argument("--max-model-len-bounds", default="128:32768", metavar="MIN:MAX")
    a.add_argument("--replicas-bounds", default="1:1", metavar="MIN:MAX", help="spec.autoscaling min:max")
    a.add_argument("--replica-startup", type=float, default=REPLICA_STARTUP_S,
                   help="seconds a replica the autotuner adds takes to serve (pod start, weights)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS")
    p.add_argument("--every-row", action="store_true", help="a table row every interval, not only on changes")
    p.add_argument("--save-result", default=None, metavar="FILE")
    p.add_argument("--plot", default=None, metavar="PNG")
    p.set_defaults(func=_cmd)
    from . import bench_table, contest_cli

    contest_cli.add_parser(sub)
    bench_table.add_parser(sub)
