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


MODEL_FORMS = "a model directory, file:///PATH, hf://ORG/NAME[@REVISION], s3://BUCKET/PREFIX or builtin:tiny"


def check_before_loading(args: argparse.Namespace) -> None:
    """What can be wrong with `kvpilot serve`'s invocation, found in milliseconds, before
    torch and the weights load (seconds to minutes): a missing --model, a local model path
    that is not a model, a port another process holds. ValueError naming the flag."""
    import socket

    from ..loader.source import resolve_model

    model = getattr(args, "model", None)
    simulated = any(v is not None for k, v in vars(args).items() if k.startswith("simulate_"))
    if not model and not simulated:
        raise ValueError(f"--model is required: {MODEL_FORMS}")
    if model and not model.startswith(("builtin:", "hf://", "s3://")):
        try:
            resolve_model(model)  # a local directory: checked, nothing loaded
        except ValueError as e:
            raise ValueError(f"--model: {e}") from None
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    try:
        infos = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {args.host!r}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            raise ValueError(f"--port {args.port}: cannot listen on {args.host}:{args.port}: {e.strerror}") from None


def _heartbeat(started: float, what: list[str]):
    """Log what start-up is doing every 5 s until the returned event is set."""
    import threading
    import time

    done = threading.Event()

    def beat() -> None:
        while not done.wait(5.0):
            log.info("still starting: %s (%.0f s)", what[0], time.monotonic() - started)
    threading.Thread(target=beat, name="kvpilot-startup-log", daemon=True).start()
    return done


def cmd_serve(args: argparse.Namespace) -> int:
    import time

    started = time.monotonic()
    check_before_loading(args)
    what = ["importing the engine (torch)"]
    log.info("kvpilot serve: %s", what[0])
    done = _heartbeat(started, what)
    try:
        return _serve(args, what, done, started)
    finally:
        done.set()


def _serve(args: argparse.Namespace, what: list[str], done, started: float) -> int:
    import time

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
    what[0] = f"loading {config.model} and sizing its KV cache"
    log.info("kvpilot serve: %s", what[0])
    engine = LLMEngine(config)
    done.set()
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
    log.info("serving %s on http://%s:%d (max_num_seqs=%d, max_model_len=%d; started in %.1f s)", name,
             args.host, args.port, engine.max_num_seqs, engine.max_model_len, time.monotonic() - started)
    code = run_server(app, app.state.kvpilot, args.host, args.port,
                      access_log=not args.disable_uvicorn_access_log,
                      log_level=logging.getLevelName(logging.getLogger().level).lower())
    if recorder is not None:
        from ..sim.steps import write_records

        write_records(args.record_steps, recorder.records, {"model": config.model, "source": "kvpilot serve"})
        log.info("wrote %d step times to %s", len(recorder.records), args.record_steps)
    return code
