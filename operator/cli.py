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
    le = p.add_argument_group("leader election (a coordination.k8s.io/v1 Lease, as controller-runtime)")
    le.add_argument("--leader-elect", action=argparse.BooleanOptionalAction, default=False,
                    help="run only while holding the Lease (several replicas: one leader, the rest standby)")
    le.add_argument("--leader-election-namespace", default=None,
                    help="the Lease's namespace (default: $POD_NAMESPACE, else the service account's)")
    le.add_argument("--leader-election-id", default="kvpilot-operator", help="the Lease's name")
    le.add_argument("--leader-elect-lease-duration", type=float, default=15.0,
                    help="seconds a standby waits on an unrenewed Lease before taking it over")
    le.add_argument("--leader-elect-renew-deadline", type=float, default=10.0,
                    help="seconds the leader keeps trying to renew before it stops acting (exiting if a "
                         "pass is still in flight or another candidate took the Lease)")
    le.add_argument("--leader-elect-retry-period", type=float, default=2.0,
                    help="seconds between attempts to acquire or renew")
    p.add_argument("--max-concurrent-reconciles", type=_positive_int, default=8,
                   help="resync reconciles running at once (each in a worker thread); one object never "
                        "has two at once")
    eng = p.add_argument_group("engine pods (what an LLMDeployment leaves out)")
    eng.add_argument("--engine-image", default=None,
                     help="the engine image (default: kvpilot/engine:<this version>); spec.engine.image overrides")
    eng.add_argument("--simulated-engine-image", default=None,
                     help="the image of simulated engine pods (engine.simulate) that name none (default: "
                          "kvpilot/operator:<this version>, which holds no torch); spec.engine.image overrides")
    eng.add_argument("--gpu-resource-name", default=None,
                     help="the extended resource GPUs are requested as (default nvidia.com/gpu)")
    eng.add_argument("--engine-defaults", default=None, metavar="JSON",
                     help="pod defaults as JSON: {pod: {imagePullSecrets, serviceAccountName, annotations, "
                          "labels, securityContext}, scheduling: {nodeSelector, tolerations, affinity, "
                          "priorityClassName}} (the chart's engine values)")
    p.set_defaults(func=_cmd_operator)

    p = subparsers.add_parser("crd", help="print the LLMDeployment CRD (YAML)")
    p.set_defaults(func=_cmd_crd)

    from .autotune.virtual import simulate_cli

    simulate_cli.add_parser(subparsers)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"--max-concurrent-reconciles must be >= 1, got {value}")
    return value


def _cmd_crd(args: argparse.Namespace) -> int:
    from .api.crd import crd_yaml

    print(crd_yaml(), end="")
    return 0


def engine_defaults(args: argparse.Namespace) -> str:
    """The OperatorDefaults the flags give, as the JSON reconcile reads from the environment;
    ValueError naming the flag when they are invalid."""
    import json

    from pydantic import ValidationError

    from .api.defaults import OperatorDefaults

    try:
        raw = json.loads(args.engine_defaults) if args.engine_defaults else {}
        if not isinstance(raw, dict):
            raise ValueError("must be a JSON object")
        if args.engine_image:
            raw["engineImage"] = args.engine_image
        if args.simulated_engine_image:
            raw["simulatedImage"] = args.simulated_engine_image
        if args.gpu_resource_name:
            raw["gpuResourceName"] = args.gpu_resource_name
        return OperatorDefaults.model_validate(raw).model_dump_json(by_alias=True, exclude_none=True)
    except (ValueError, ValidationError) as e:
        raise ValueError(f"--engine-defaults/--engine-image/--simulated-engine-image/--gpu-resource-name: {e}") from None


def _cmd_operator(args: argparse.Namespace) -> int:
    from .kube_config import load_kube_config

    load_kube_config()  # no API to reach: one line and exit 2 now, not a traceback every minute
    from .api.defaults import DEFAULTS_ENV

    os.environ[DEFAULTS_ENV] = engine_defaults(args)
    os.environ["KVPILOT_RESYNC_SECONDS"] = str(args.resync_interval)
    os.environ["KVPILOT_MAX_CONCURRENT_RECONCILES"] = str(args.max_concurrent_reconciles)
    os.environ["KVPILOT_WATCH_NAMESPACES"] = ",".join(args.namespace or [])
    import kopf

    from . import handlers  # noqa: F401  (registers the handlers)

    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.bind_address)
    namespaces = args.namespace or []
    if args.leader_elect:
        from .ha.leader_run import run_elected

        # kopf's peering stays off (standalone): the Lease decides who runs kopf at all.
        def run_kopf(leading):  # the handlers find the leadership check in kopf's memo
            return kopf.operator(standalone=True, clusterwide=not namespaces, namespaces=namespaces,
                                 memo=kopf.Memo(leading=leading))
        return run_elected(election_config(args), run_kopf, args.bind_address, args.liveness_port)
    liveness = f"http://{args.bind_address}:{args.liveness_port}/healthz" if args.liveness_port else None
    kopf.run(standalone=True, clusterwide=not namespaces, namespaces=namespaces,
             liveness_endpoint=liveness)
    return 0


def election_config(args: argparse.Namespace):
    """The leader-election settings from the flags, validated (ValueError names the flag)."""
    from .ha.election import ElectionTiming
    from .ha.leader_run import ElectionConfig, default_identity, default_namespace

    try:
        timing = ElectionTiming(args.leader_elect_lease_duration, args.leader_elect_renew_deadline,
                                args.leader_elect_retry_period)
    except ValueError as e:
        raise ValueError(f"--leader-elect-*: {e}") from None
    return ElectionConfig(namespace=args.leader_election_namespace or default_namespace(),
                          lease_name=args.leader_election_id, identity=default_identity(), timing=timing)
