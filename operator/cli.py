"""`kvpilot operator` and `kvpilot crd`. Importing this module loads nothing
heavy: kopf and the kubernetes client are imported when the command runs."""
from __future__ import annotations

import argparse
import os


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("operator", help="run the LLMDeployment operator (kopf)")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=None,
                       help="watch this namespace (repeatable); default: all namespaces")
    scope.add_argument("--all-namespaces", "-A", action="store_true")
    p.add_argument("--metrics-port", type=int, default=8080, help="the operator's /metrics (0: off)")
    p.add_argument("--liveness-port", type=int, default=8081, help="kopf's /healthz (0: off)")
    p.add_argument("--bind-address", default="0.0.0.0")
    p.add_argument("--resync-interval", type=float, default=30.0,
                   help="seconds between level-based re-reconciles of each LLMDeployment")
    p.add_argument("--max-concurrent-reconciles", type=_positive_int, default=8,
                   help="resync reconciles running at once (each in a worker thread); one object never "
                        "has two at once")
    p.set_defaults(func=_cmd_operator)

    p = subparsers.add_parser("crd", help="print the LLMDeployment CRD (YAML)")
    p.set_defaults(func=_cmd_crd)

    from .autotune import simulate_cli

    simulate_cli.add_parser(subparsers)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"--max-concurrent-reconciles must be >= 1, got {value}")
    return value


def _cmd_crd(args: argparse.Namespace) -> int:
    from .crd import crd_yaml

    print(crd_yaml(), end="")
    return 0


def _cmd_operator(args: argparse.Namespace) -> int:
    os.environ["KVPILOT_RESYNC_SECONDS"] = str(args.resync_interval)
    os.environ["KVPILOT_MAX_CONCURRENT_RECONCILES"] = str(args.max_concurrent_reconciles)
    os.environ["KVPILOT_WATCH_NAMESPACES"] = ",".join(args.namespace or [])
    import kopf

    from . import handlers  # noqa: F401  (registers the handlers)

    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.bind_address)
    liveness = f"http://{args.bind_address}:{args.liveness_port}/healthz" if args.liveness_port else None
    namespaces = args.namespace or []
    kopf.run(standalone=True, clusterwide=not namespaces, namespaces=namespaces,
             liveness_endpoint=liveness)
    return 0
