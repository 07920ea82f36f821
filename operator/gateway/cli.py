"""`kvpilot gateway`: registered by module name (pyproject's kvpilot.commands entry points),
so the engine's command line never imports the operator."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path

from kvpilot.engine.config.flags import add_dataclass_flags, dataclass_from_args

from .config import GatewaySettings

log = logging.getLogger("kvpilot.gateway")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("gateway", help="one OpenAI endpoint for many LLMDeployments (prefix- and "
                              "load-aware routing, tenants, rate limits)")
    add_dataclass_flags(p, GatewaySettings, prefix="")
    p.add_argument("--backend", action="append", default=[], metavar="MODEL=URL[,URL...]",
                   help="serve MODEL from these engine URLs instead of discovering LLMDeployments "
                        "(repeatable; no Kubernetes API needed)")
    p.add_argument("--namespace", "-n", action="append", default=[],
                   help="serve the LLMDeployments of this namespace (repeatable); default: all namespaces")
    p.set_defaults(func=_cmd_gateway)

    from .bench import add_parser as add_bench_parser

    add_bench_parser(subparsers)


def read_key(path: str, flag: str) -> str:
    """A key from its file (a mounted Secret), stripped; ValueError naming the flag."""
    try:
        key = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag}: cannot read {path}: {e}") from None
    if not key:
        raise ValueError(f"{flag}: {path} is empty")
    return key


def _cmd_gateway(args: argparse.Namespace) -> int:
    settings = dataclass_from_args(GatewaySettings, args, prefix="", backend=args.backend,
                                   namespace=args.namespace)
    if not settings.backend:  # discovery needs the API: say so now, in one line
        from ..kube_config import load_kube_config

        load_kube_config()
    # uvloop where installed (uvicorn[standard] brings it): the proxy's per-chunk path is
    # mostly event-loop work (socket reads and writes, futures), which uvloop does in C.
    try:
        import uvloop
    except ImportError:
        return asyncio.run(serve(settings))
    return uvloop.run(serve(settings))


async def serve(settings: GatewaySettings) -> int:
    import httpx
    import uvicorn

    from .app import Gateway
    from .discovery import KubernetesDiscovery, parse_backend_flag
    from .forward import upstream_session
    from .picker import Picker
    from .scrape import scrape_loop
    from .table import RoutingTable
    from .tenants import Tenants

    from .edge import edge_protocol

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per scrape
    engine_key = read_key(settings.engine_api_key_file, "--engine-api-key-file") if settings.engine_api_key_file \
        else os.environ.get("KVPILOT_ENGINE_API_KEY") or None
    metrics_key = read_key(settings.metrics_key_file, "--metrics-key-file") if settings.metrics_key_file else None
    tenants = Tenants.load(settings.tenants_file) if settings.tenants_file else Tenants.unrestricted()
    table = RoutingTable(lambda: Picker(settings.routing, settings.load_factor,
                                        kv_saturation=settings.kv_saturation), settings.per_replica_concurrency)
    # Proxied requests on aiohttp (the hot path); the once-a-second scrapes stay on httpx.
    async with upstream_session(settings.connect_timeout) as upstream, \
            httpx.AsyncClient(timeout=httpx.Timeout(settings.scrape_interval)) as scraper:
        tasks = []
        if settings.backend:
            table.update([parse_backend_flag(b) for b in settings.backend])
            gateway = Gateway(settings, table, tenants, upstream, engine_key=engine_key, metrics_key=metrics_key)
        else:
            discovery = KubernetesDiscovery(settings.namespace, settings.refresh_interval)
            gateway = Gateway(settings, table, tenants, upstream, waker=discovery.scaler, engine_key=engine_key,
                              metrics_key=metrics_key)

            def refresh(snapshots) -> None:
                table.update(snapshots)
                gateway.refreshed()
            tasks.append(asyncio.create_task(discovery.run(refresh)))
        tasks.append(asyncio.create_task(scrape_loop(scraper, table.all_replicas, settings.scrape_interval)))
        log.warning("gateway: %s routing on %s:%d (event loop: %s); %s; tenants: %s", settings.routing,
                    settings.host, settings.port, type(asyncio.get_running_loop()).__module__.split(".")[0],
                    f"backends {', '.join(table.models())}" if settings.backend else
                    f"LLMDeployments in {', '.join(settings.namespace) or 'all namespaces'}",
                    ", ".join(t.name for t in tenants.tenants) or "none (open)")
        config = uvicorn.Config(gateway, host=settings.host, port=settings.port, log_level="warning",
                                access_log=False, lifespan="on", timeout_keep_alive=75,
                                http=edge_protocol(settings.header_read_timeout, settings.max_header_bytes,
                                                   settings.max_headers, settings.write_timeout))
        try:
            await uvicorn.Server(config).serve()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return 0
