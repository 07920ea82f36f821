"""Startup, readiness and liveness probes (httpGet, tcpSocket, exec) with the
kubelet's timing fields: initialDelaySeconds, periodSeconds, timeoutSeconds,
successThreshold and failureThreshold."""
from __future__ import annotations

import socket
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import httpx

_POOL = ThreadPoolExecutor(max_workers=32, thread_name_prefix="probe")


def _port(port: int | str, container: dict) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"named port {port!r} not in container {container['name']}")


def run_probe(probe: dict, ip: str, container: dict, exec_fn: Callable[[list[str], float], int]) -> bool:
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "httpGet" in probe:
            h = probe["httpGet"]
            scheme = h.get("scheme", "HTTP").lower()
            host = h.get("host") or ip
            url = f"{scheme}://{host}:{_port(h['port'], container)}{h.get('path', '/')}"
            headers = {x["name"]: x["value"] for x in h.get("httpHeaders") or []}
            r = httpx.get(url, headers=headers, timeout=timeout, verify=False, follow_redirects=True)
            return 200 <= r.status_code < 400
        if "tcpSocket" in probe:
            t = probe["tcpSocket"]
            with socket.create_connection((t.get("host") or ip, _port(t["port"], container)), timeout):
                return True
        if "exec" in probe:
            return exec_fn(probe["exec"]["command"], timeout) == 0
        if "grpc" in probe:
            with socket.create_connection((ip, int(probe["grpc"]["port"])), timeout):
                return True  # a reachable port stands in for the gRPC health check
    except (OSError, httpx.HTTPError, ValueError, subprocess.TimeoutExpired):
        return False
    return False


class ProbeState:
    """One probe of one container; `tick` starts due probes and folds results
    into `result` (True, False or None while undecided)."""

    def __init__(self, probe: dict | None, *, initial: bool | None):
        self.probe = probe
        self.initial = initial
        self.result: bool | None = initial if probe else True
        self.successes = 0
        self.failures = 0
        self.started_at = 0.0
        self.next_at = 0.0
        self.pending: Future | None = None

    def reset(self, now: float) -> None:
        self.result = self.initial if self.probe else True
        self.successes = self.failures = 0
        self.started_at = now
        self.next_at = now + float(self.probe.get("initialDelaySeconds", 0)) if self.probe else now
        self.pending = None

    def tick(self, now: float, ip: str, container: dict, exec_fn) -> bool:
        """Returns True when `result` changed."""
        if not self.probe:
            return False
        changed = False
        if self.pending is not None and self.pending.done():
            ok = self.pending.result()
            self.pending = None
            if ok:
                self.successes, self.failures = self.successes + 1, 0
                if self.successes >= int(self.probe.get("successThreshold", 1)) and self.result is not True:
                    self.result, changed = True, True
            else:
                self.failures, self.successes = self.failures + 1, 0
                if self.failures >= int(self.probe.get("failureThreshold", 3)) and self.result is not False:
                    self.result, changed = False, True
        if self.pending is None and now >= self.next_at:
            self.next_at = now + float(self.probe.get("periodSeconds", 10))
            self.pending = _POOL.submit(run_probe, self.probe, ip, container, exec_fn)
        return changed
