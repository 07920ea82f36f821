"""`kvpilot sim`: the virtual-clock simulator on the command line.

  kvpilot sim run --simulate h100-80gb --simulate-model llama-3.1-8b --max-model-len 8192 \\
      --phase "duration=3600 rate=6 input=lognormal:800:0.8 output=lognormal:250:0.8"
  kvpilot sim trace --phase "..." --out day.jsonl      (write a generated trace)
  kvpilot sim describe --simulate l4 --simulate-model llama-3.1-8b  (capacity and step times)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time


def add_workload_args(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    src = w.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", default=None, help="a JSONL trace (arrival, prompt_len, output_len, ...)")
    src.add_argument("--phase", action="append", default=None, metavar="SPEC",
                     help='a phase of generated traffic, e.g. "duration=600 rate=4 input=uniform:128:1024 '
                          'output=lognormal:200:0.8 burstiness=1 prefix_len=0"; repeat for more phases')
    from .scenarios import SCENARIOS  # light: the parser has its trace and config modules already

    src.add_argument("--scenario", default=None, metavar="NAME", choices=tuple(SCENARIOS),
                     help="the trace of a named, seeded scenario: day, preemption, long-max-model-len, "
                          "scheduler-bound (kvpilot sim scenarios lists them with the accelerator and "
                          "settings `kvpilot autotune contest` runs them on)")
    w.add_argument("--trace-seed", type=int, default=0, help="the trace generator's seed")
    add_trace_options(w)


def add_trace_options(w) -> None:
    """How a --trace file is read: shared by `sim run`, `autotune simulate` and `contest`."""
    from .trace_formats import FORMATS

    w.add_argument("--trace-format", default="kvpilot", choices=FORMATS,
                   help="the --trace file's schema: kvpilot JSONL, Azure LLM inference 2023/2024 CSV, "
                        "BurstGPT CSV, Mooncake JSONL (hash_ids: shared prefix blocks)")
    w.add_argument("--trace-start", type=float, default=0.0, metavar="S",
                   help="replay from this many seconds after the trace's first request")
    w.add_argument("--trace-duration", type=float, default=None, metavar="S", help="replay this many seconds")
    w.add_argument("--trace-rate-scale", type=float, default=1.0, metavar="X",
                   help="arrivals X times as fast (inter-arrival gaps divided by X)")
    w.add_argument("--trace-block-size", type=int, default=512, help="tokens per hash id (mooncake)")
    w.add_argument("--no-clip", action="store_true",
                   help="keep requests longer than the model's context (they are refused) instead of clipping")


def load_trace_from_args(args, max_context: int | None):
    """The --trace file as LoadedTrace (trace_formats), its notes printed by the caller."""
    from .trace_formats import TraceOptions, load_trace

    opts = TraceOptions(fmt=args.trace_format, start_s=args.trace_start, duration_s=args.trace_duration,
                        rate_scale=args.trace_rate_scale, block_size=args.trace_block_size,
                        max_context=None if args.no_clip else max_context)
    return load_trace(args.trace, opts)


def trace_from_args(args, max_len: int | None, context: int | None = None):
    from .trace import Phase, generate

    if args.trace:
        loaded = load_trace_from_args(args, context)
        s = loaded.summary()
        print(f"trace {s['source']}: {s['requests']} requests over {s['duration_s']:.0f} s "
              f"({s['mean_rate_per_s']:.2f}/s)" + "".join(f"; {n}" for n in loaded.notes), file=sys.stderr)
        return loaded.requests
    if getattr(args, "scenario", None):
        from .scenarios import scenario

        return scenario(args.scenario).trace()
    return list(generate([Phase.parse(text) for text in args.phase], seed=args.trace_seed, max_len=max_len))


def _cmd_run(args: argparse.Namespace) -> int:
    from ..bench.serve_stats import parse_goodput
    from ..config.args import engine_config_from_args
    from .fleet import Fleet
    from .report import print_sim_result, summarize

    if args.scenario and getattr(args, "simulate_accelerator", None) is None:
        # A scenario names its accelerator, model and starting settings; flags given override them.
        from dataclasses import fields

        from .scenarios import scenario

        given = {f.name: getattr(args, f.name) for f in fields(scenario(args.scenario).engine_config())
                 if f.name != "simulate" and getattr(args, f.name, None) is not None}
        config = scenario(args.scenario).engine_config(**given)
    else:
        config = engine_config_from_args(args)
    if config.simulate is None:
        raise ValueError("kvpilot sim run needs --simulate ACCELERATOR (and --simulate-model), or --scenario NAME")
    goodput = parse_goodput(args.goodput)
    fleet = Fleet(config, replicas=args.replicas, router=args.router,
                  scrape_interval=args.scrape_interval, max_concurrency=args.max_concurrency)
    engine = fleet.replicas[0].engine
    trace = trace_from_args(args, engine.max_model_len, engine.runner.max_position_embeddings)
    if not trace:
        raise ValueError("phase: the phases generate no requests (every rate is 0 or too low for the duration)")
    horizon = max(r.arrival for r in trace)
    started = time.perf_counter()
    fleet.submit(trace)
    from tqdm.auto import tqdm

    with tqdm(total=math.ceil(horizon), unit="sim s", desc="simulating", disable=args.disable_tqdm,
              file=sys.stderr) as bar:
        t = 0.0
        while t < horizon:
            t = min(t + 10.0, horizon)
            fleet.run_until(t)
            bar.update(min(math.ceil(t), bar.total) - bar.n)
    fleet.run(())
    wall = time.perf_counter() - started
    result = summarize(fleet, goodput)
    result["wall_s"] = wall
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_sim_result(result)
        print(f"{'Simulated / wall time (s):':<40} {result['duration']:.0f} / {wall:.1f}")
    write_run_outputs(fleet, result, args, f"{result['accelerator']} x{result['replicas']}, "
                                           f"{config.simulate.model}, {result['completed']} requests")
    return 0 if result["completed"] else 1


def write_run_outputs(fleet, result: dict, args: argparse.Namespace, title: str) -> None:
    """--save-result, --plot and --save-scrapes, where the command has them."""
    if getattr(args, "save_result", None):
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)
    if getattr(args, "plot", None):
        from .report import plot_scrapes

        plot_scrapes(fleet, args.plot, title)
        print(f"plot: {args.plot}")
    if getattr(args, "save_scrapes", None):
        with open(args.save_scrapes, "w") as f:
            for sc in fleet.scrapes:
                f.write(json.dumps({"time": sc.time, "replica": sc.replica, "samples": [
                    [s.name, s.labels, s.value] for s in sc.samples]}) + "\n")


def _cmd_trace(args: argparse.Namespace) -> int:
    from .trace import write_trace

    n = write_trace(args.out, trace_from_args(args, args.max_len))
    print(f"wrote {n} requests to {args.out}")
    return 0


def _cmd_scenarios(args: argparse.Namespace) -> int:
    from .scenarios import SCENARIOS

    for sc in SCENARIOS.values():
        print(f"{sc.name}: {sc.summary}")
        print(f"  {sc.accelerator} / {sc.model}; starts at max_num_seqs={sc.max_num_seqs} "
              f"max_model_len={sc.max_model_len} max_num_batched_tokens={sc.max_num_batched_tokens} "
              f"x{sc.replicas} (autoscalers up to {sc.max_replicas}); seed {sc.seed}")
        for (name, start, end), ph, slo in zip(sc.boundaries(), sc.phases, sc.slos):
            prefix = f" prefix {ph.prefix_len} x{ph.prefix_groups} on {ph.prefix_fraction:.0%}" if ph.prefix_len else ""
            print(f"  {start:6.0f}-{end:<6.0f}s {name:<9} {ph.rate:g} req/s (burstiness {ph.burstiness:g}), "
                  f"prompts {ph.input}, outputs {ph.output}{prefix}; {slo}")
    return 0


def _cmd_describe(args: argparse.Namespace) -> int:
    from ..config.args import engine_config_from_args
    from ..core.clock import VirtualClock
    from ..llm_engine import LLMEngine
    from ..sim.timing import BatchShape, step_cost

    config = engine_config_from_args(args)
    if config.simulate is None:
        raise ValueError("kvpilot sim describe needs --simulate ACCELERATOR")
    engine = LLMEngine(config, VirtualClock())
    ex = engine.runner
    print(ex.describe())
    print(f"KV cache: {engine.kv_capacity_tokens} tokens ({engine.kv_cache.num_blocks} blocks of "
          f"{config.block_size}); {ex.model.kv_bytes_per_token} bytes per token; holds "
          f"{engine.kv_capacity_tokens // engine.max_model_len} sequences of max_model_len "
          f"{engine.max_model_len}")
    tp = ex.parallel
    print("\nstep times (modelled):")
    # With tensor parallelism, the all-reduces' share of each step (included in its time).
    comm_head = f"{'all-reduce ms':>14}" if tp.size > 1 else ""
    print(f"{'step':<34}{'time ms':>9}{'tokens/s':>11}{comm_head}  bound")
    for label, shape in [(f"decode batch {b}, context {c}", BatchShape.of([(1, c)] * b))
                         for b, c in ((1, 1024), (8, 1024), (32, 1024), (64, 2048), (128, 2048), (256, 2048))
                         ] + [(f"one prefill of {n} tokens", BatchShape.of([(n, n)])) for n in (512, 2048, 8192)]:
        cost = step_cost(ex.model, ex.accelerator, shape, tp)
        rate = (shape.num_sampled if shape.num_tokens == shape.num_seqs else shape.num_tokens) / cost.total_s
        bound = "memory" if cost.gemm_memory_bound else "compute"
        comm = f"{cost.communication_s * 1000:>14.2f}" if tp.size > 1 else ""
        print(f"{label:<34}{cost.total_s * 1000:>9.2f}{rate:>11.0f}{comm}  {bound}")
    return 0


def _cmd_record(args: argparse.Namespace) -> int:
    import os

    from ..config.args import engine_config_from_args
    from ..llm_engine import LLMEngine
    from ..sim.steps import record_grids, write_records

    config = engine_config_from_args(args)
    if config.simulate is not None:
        raise ValueError("kvpilot sim record measures the real engine: leave out --simulate")
    config.enable_prefix_caching = False  # every step computes what its shape says
    engine = LLMEngine(config)
    sync = lambda: None  # noqa: E731
    device = getattr(engine.runner, "device", None)
    if device is not None and device.type == "cuda":
        import torch

        sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
    records = record_grids(engine, args.grid, sync=sync,
                           progress=lambda s: print(f"recording {s}", file=sys.stderr, flush=True))
    meta = {"model": config.model, "device": str(device), "dtype": str(getattr(engine.runner, "dtype", "")),
            "grids": args.grid, "cpu_count": os.cpu_count(), "max_num_batched_tokens": config.max_num_batched_tokens}
    write_records(args.out, records, meta)
    print(f"wrote {len(records)} measured steps to {args.out}")
    return 0


def _records(args):
    from ..sim.steps import read_records

    records, meta = read_records(args.steps)
    if args.grid:
        records = [r for r in records if r.grid == args.grid]
        if not records:
            raise ValueError(f"steps: {args.steps} has no steps of grid {args.grid!r}")
    return records, meta


def _recorded_shape(args, meta: dict):
    """The recorded model's shape: --simulate-model, else the config the file carries
    (gpu_check's), else the model it names."""
    from ..sim.shapes import ModelShape, resolve_model_shape

    if args.simulate_model:
        return resolve_model_shape(args.simulate_model, args.dtype)
    if isinstance(meta.get("config"), dict):
        return ModelShape.from_config(meta["config"], str(meta.get("model", "recorded model")), args.dtype)
    if meta.get("model"):
        return resolve_model_shape(str(meta["model"]), args.dtype)
    raise ValueError(f"steps: {args.steps} names no model; give --simulate-model")


def _base_accelerator(args):
    from ..sim.hardware import resolve_accelerator
    from ..sim.steps import host_accelerator

    return resolve_accelerator(args.base) if args.base else host_accelerator()


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from .calibrate import fit
    from ..sim.hardware import CALIBRATED_FIELDS
    records, meta = _records(args)
    model = _recorded_shape(args, meta)
    acc, report = fit(model, _base_accelerator(args), records)
    out = {**acc.to_json(), "fitted": {k: getattr(acc, k) for k in CALIBRATED_FIELDS},
           "fit": {"steps": args.steps, "model": model.name, **report.__dict__}}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"fitted {acc.name}: effective bandwidth {acc.effective_bandwidth / 1e9:.2f} GB/s, GEMM "
          f"{acc.effective_gemm_flops / 1e9:.1f} GFLOP/s, attention {acc.effective_attention_flops / 1e9:.1f} "
          f"GFLOP/s; overhead {acc.step_overhead_s * 1e3:.3f} ms/step + {acc.per_seq_overhead_s * 1e6:.1f} us/seq "
          f"+ {acc.per_token_overhead_s * 1e6:.2f} us/token")
    print(f"fit error on its own steps: {report.describe()}")
    print(f"wrote {args.out} (use it as --simulate {args.out}, or its 'fitted' block as --simulate-calibration)")
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    from .calibrate import errors
    from ..sim.hardware import resolve_accelerator
    records, meta = _records(args)
    model = _recorded_shape(args, meta)
    acc = resolve_accelerator(args.simulate, args.simulate_calibration)
    report = errors(model, acc, records)
    print(f"SIMULATED {acc.name} predicting {args.steps}: {report.describe()}")
    if args.json:
        print(json.dumps(report.__dict__))
    return 0


def _cmd_fidelity(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .fidelity import print_fidelity, run_fidelity

    result = run_fidelity(Path(args.out_dir), rounds=args.rounds)
    print_fidelity(result)
    print(f"details: {args.out_dir}/sim-fidelity.json, plot: {args.out_dir}/sim-fidelity.png")
    return 0


def _cmd_published(args: argparse.Namespace) -> int:
    from .published import compare

    rows = compare()
    print("SIMULATED (uncalibrated presets) vs published vLLM measurements, bf16")
    for r in rows:
        published = f"{r['published']:8.2f}" if r["published"] is not None else f"{'n/a':>8}"
        error = f"{r['error']:+.0%}" if r["error"] is not None else ""
        gpus = f" x{r['tensor_parallel_size']}" if r["tensor_parallel_size"] > 1 else ""
        print(f"{r['model']}{gpus}: {r['what']}\n{'':<4}published {published} {r['unit']:<5} simulated "
              f"{r['simulated']:8.2f}  {error}\n{'':<4}source: {r['source']}")
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    from ..config.args import add_engine_args

    sim = subparsers.add_parser("sim", help="the virtual-clock simulator of simulated GPU replicas")
    sub = sim.add_subparsers(dest="sim_command", required=True)

    p = sub.add_parser("run", help="run a trace through simulated replicas in virtual time")
    add_engine_args(p)
    add_workload_args(p)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--router", default="round-robin", choices=("round-robin", "least-loaded"))
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="closed loop, as bench serve: at most this many requests in flight")
    p.add_argument("--scrape-interval", type=float, default=15.0,
                   help="seconds between metric scrapes, as Prometheus would take them")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, as bench serve: ttft:2000 tpot:50 e2el:...")
    p.add_argument("--json", action="store_true")
    p.add_argument("--save-result", default=None, metavar="FILE")
    p.add_argument("--save-scrapes", default=None, metavar="FILE",
                   help="every scrape as JSONL (time, replica, samples)")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="running, waiting, KV usage and output tokens/s over time, from the scrapes")
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("trace", help="write a generated trace as JSONL")
    add_workload_args(p)
    p.add_argument("--out", required=True)
    p.add_argument("--max-len", type=int, default=None, help="clip prompt + output to this many tokens")
    p.set_defaults(func=_cmd_trace)

    p = sub.add_parser("scenarios", help="list the named scenarios: phases, objectives, starting settings")
    p.set_defaults(func=_cmd_scenarios)

    p = sub.add_parser("describe", help="the modelled KV capacity and step times of an accelerator")
    add_engine_args(p)
    p.set_defaults(func=_cmd_describe)

    p = sub.add_parser("record", help="time the real engine's steps over a grid of batch shapes (JSON)")
    add_engine_args(p)
    p.add_argument("--grid", action="append", choices=("calibration", "validation"), required=True,
                   help="repeat for both: their points are interleaved")
    p.add_argument("--out", required=True)
    p.set_defaults(func=_cmd_record)

    p = sub.add_parser("calibrate", help="fit overheads and effective rates to recorded step times")
    p.add_argument("--steps", required=True, help="JSON from `kvpilot sim record`")
    p.add_argument("--grid", default=None, help="fit only the steps of this grid (e.g. calibration)")
    p.add_argument("--simulate-model", default=None, help="the recorded model's shape (default: from the file)")
    p.add_argument("--dtype", default="float32",
                   help="the dtype the steps ran in (default float32: CPU; bfloat16 for gpu_check's)")
    p.add_argument("--base", default=None,
                   help="the accelerator whose peaks to keep (a preset or JSON); default: this host's CPU, "
                        "its peaks measured by torch microbenchmarks")
    p.add_argument("--out", required=True, help="where to write the calibrated accelerator (JSON)")
    p.set_defaults(func=_cmd_calibrate)

    p = sub.add_parser("predict", help="how well an accelerator description predicts recorded steps")
    p.add_argument("--steps", required=True)
    p.add_argument("--grid", default=None, help="only the steps of this grid (e.g. validation)")
    p.add_argument("--simulate", required=True, help="a preset or accelerator JSON (e.g. from calibrate)")
    p.add_argument("--simulate-calibration", default=None)
    p.add_argument("--simulate-model", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_predict)

    p = sub.add_parser("fidelity", help="measure the simulator against the real engine on this machine "
                                        "(step times and bench serve; several minutes)")
    p.add_argument("--out-dir", default="results")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of the serving comparison")
    p.set_defaults(func=_cmd_fidelity)

    p = sub.add_parser("published", help="the uncalibrated GPU presets beside published vLLM figures")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_published)
    return sim
