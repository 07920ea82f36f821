"""`kvpilot operator --leader-elect`: a standby waits for the Lease and runs nothing
else (no kopf, no reconcile, no autotune); the leader runs kopf and renews. Every pass
runs through a PassGate, so it starts only while the Lease is held and is counted while
it runs. When another candidate takes the Lease the process exits non-zero at once, as
controller-runtime's managers do, so the pod restarts as a standby. When the leader
merely cannot renew (the API server restarting) it stops acting at the renew deadline
and, if no pass of its own is still in flight, stays up and renews when the API server
answers again, instead of restarting; a pass still in flight then is stopped the only
way it can be, by exiting, before any standby may take over (the lease duration). On
SIGTERM the leader stops kopf and releases the Lease, so the standby takes over at its
next retry instead of after a lease duration."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

from .election import ElectionTiming
from .health import Heartbeat, serve_health

log = logging.getLogger(__name__)
SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
LOST_EXIT_CODE = 1


@dataclass(frozen=True)
class ElectionConfig:
    namespace: str
    lease_name: str
    identity: str
    timing: ElectionTiming

    def __post_init__(self) -> None:
        for name in ("namespace", "lease_name", "identity"):
            if not getattr(self, name):
                raise ValueError(f"leader election: {name} must not be empty")


def default_identity(env=os.environ) -> str:
    """The pod's name (downward API) where there is one, else hostname_pid."""
    return env.get("POD_NAME") or f"{socket.gethostname()}_{os.getpid()}"


def default_namespace(env=os.environ, sa_file: Path = SA_NAMESPACE_FILE) -> str:
    """$POD_NAMESPACE, else the service account's namespace, else "default"."""
    if env.get("POD_NAMESPACE"):
        return env["POD_NAMESPACE"]
    try:
        return sa_file.read_text().strip() or "default"
    except OSError:
        return "default"


def set_leader_metric(heartbeat: Heartbeat) -> Callable[[bool], None]:
    from ..runtime import metrics

    def on_change(is_leader: bool) -> None:
        metrics.LEADER.set(1 if is_leader else 0)
        heartbeat.role = "leader" if is_leader else "standby"
        log.warning("leader election: this operator is now %s", heartbeat.role)
    return on_change


def run_elected(config: ElectionConfig, run_operator: Callable[[Callable[[], bool]], Awaitable[None]],
                health_host: str, health_port: int) -> int:
    return asyncio.run(_main(config, run_operator, health_host, health_port))


async def _main(config: ElectionConfig, run_operator: Callable[[Callable[[], bool]], Awaitable[None]],
                health_host: str, health_port: int) -> int:
    from ..runtime.apply import Kube
    from ..kube_config import load_kube_config
    from .leader import HoldEnd, KubeLeaseStore, LeaderElector, PassGate

    heartbeat = Heartbeat()
    beat = asyncio.create_task(heartbeat.beat())
    if health_port:
        serve_health(heartbeat, health_host, health_port)
    load_kube_config()
    elector = LeaderElector(KubeLeaseStore(Kube(), config.namespace, config.lease_name), config.identity,
                            config.timing, on_change=set_leader_metric(heartbeat))
    log.warning("leader election: %s waits for Lease %s/%s", config.identity, config.namespace, config.lease_name)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    acquire, stopped = asyncio.create_task(elector.acquire()), asyncio.create_task(stop.wait())
    await asyncio.wait({acquire, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not acquire.done():  # a standby asked to stop: it holds nothing to release
        acquire.cancel()
        beat.cancel()
        return 0

    # The leader. hold() is created before kopf starts: kopf's run_tasks leaves the tasks
    # that existed before it alone. kopf replaces the signal handlers with its own.
    gate = PassGate(elector.holds)
    hold = asyncio.create_task(elector.hold())
    operator = asyncio.create_task(run_operator(gate))  # each pass runs inside gate.acting()
    while True:
        await asyncio.wait({hold, operator}, return_when=asyncio.FIRST_COMPLETED)
        if operator.done():
            break
        if hold.result() is HoldEnd.TAKEN or gate.in_flight():
            why = ("another candidate holds the Lease" if hold.result() is HoldEnd.TAKEN else
                   f"{gate.in_flight()} pass(es) still in flight past the renew deadline")
            log.error("leader election: leadership lost (%s); exiting at once so that no reconcile or "
                      "autotune pass of this process overlaps the new leader's", why)
            sys.stderr.flush()
            os._exit(LOST_EXIT_CODE)  # no cleanup: kopf's worker threads must not finish their passes
        log.warning("leader election: not renewed within the renew deadline and no pass in flight: "
                    "acting on nothing until the Lease is renewed (or exiting if another candidate takes it)")
        hold = asyncio.create_task(elector.hold())
    hold.cancel()
    await asyncio.to_thread(elector.release)
    beat.cancel()
    failed = operator.exception() is not None
    if failed:
        log.error("the operator stopped: %r", operator.exception())
    return 1 if failed else 0
