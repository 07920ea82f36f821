"""`kvpilot serve`: registers the subcommand; fastapi/uvicorn load only when it runs."""

from __future__ import annotations

import argparse
import logging
import os

log = logging.getLogger("kvpilot.server")


def add_parser(subparsers) -> argparse.ArgumentParser:
    from ..config.args import add_engine_args
    from ..config.flags import add_dataclass_flags
    from .limits import ServerLimits

    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_engine_args(p)
    add_dataclass_flags(p.add_argument_group("request limits"), ServerLimits, "")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* (default: $KVPILOT_API_KEY)")
    p.add_argument("--tuning-file", default=None,
                   help="JSON file with live limits (max_num_seqs, max_model_len), re-read on change")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="answer 429 while this many requests wait (default: unlimited)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for in-flight requests before aborting them")
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    p.add_argument("--record-steps", default=None, metavar="FILE",
                   help="time every engine step and write them (with their shapes) to FILE at exit, "
                        "for `kvpilot sim calibrate`")
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args: argparse.Namespace) -> int:
    from ..config.args import engine_config_from_args
    from ..config.flags import dataclass_from_args
    from ..llm_engine import LLMEngine
    from .limits import ServerLimits
    from .app import build_app
    from .async_engine import AsyncEngine
    from ..metrics.exporter import ServerMetrics
    from .runner import run_server
    from .serving_common import ServerSettings

    if args.max_queued_requests is not None and args.max_queued_requests < 1:
        raise ValueError(f"max_queued_requests must be at least 1, got {args.max_queued_requests}")
    if args.drain_timeout < 0:
        raise ValueError(f"drain_timeout must be non-negative, got {args.drain_timeout}")
    limits = dataclass_from_args(ServerLimits, args, "")
    config = engine_config_from_args(args)
    engine = LLMEngine(config)
    name = config.model_name
    metrics = ServerMetrics(name, engine.max_model_len_ceiling)
    if config.simulate is not None:
        metrics.record_simulation(engine.runner.accelerator.name, engine.runner.model.name)
    settings = ServerSettings(
        served_model_name=name, model_path=config.model,
        max_queued_requests=args.max_queued_requests,
        api_key=args.api_key or os.environ.get("KVPILOT_API_KEY") or None,
        drain_timeout=args.drain_timeout, limits=limits,
    )
    recorder = None
    if args.record_steps:
        from ..sim.steps import StepRecorder

        recorder = StepRecorder(engine)
        recorder.install()
    async_engine = AsyncEngine(engine, metrics)
    app = build_app(async_engine, settings, tuning_file=args.tuning_file)
    log.info("serving %s on http://%s:%d (max_num_seqs=%d, max_model_len=%d)", name, args.host,
             args.port, engine.max_num_seqs, engine.max_model_len)
    code = run_server(app, app.state.kvpilot, args.host, args.port,
                      access_log=not args.disable_uvicorn_access_log,
                      log_level=logging.getLevelName(logging.getLogger().level).lower())
    if recorder is not None:
        from ..sim.steps import write_records

        write_records(args.record_steps, recorder.records, {"model": config.model, "source": "kvpilot serve"})
        log.info("wrote %d step times to %s", len(recorder.records), args.record_steps)
    return code
