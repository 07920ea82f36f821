"""What the gateway knows about each serving pod: where it is, whether it is ready, the
requests it has from this gateway, and the load it last reported on /metrics."""
from __future__ import annotations

from dataclasses import dataclass, field

# vLLM's gauges, as every kvpilot engine pod exports them.
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTED = "kvpilot:num_requests_preempted"  # waiting too, outside vLLM's gauge (queue cap)
KV_USAGE = "vllm:kv_cache_usage_perc"


@dataclass
class ReplicaLoad:
    """A pod's own report (None until the first scrape answers)."""
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    scraped_at: float | None = None


@dataclass
class Replica:
    name: str  # the pod's name: stable across scrapes, the ring's id
    url: str  # http://IP:PORT
    in_flight: int = 0  # requests this gateway has open on it now
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    failures: int = 0  # consecutive timeouts or failures (0 after a good answer)
    ejected_until: float = 0.0  # passive outlier ejection: skipped until then (monotonic clock)

    def ejected(self, now: float) -> bool:
        return now < self.ejected_until

    def fail(self, now: float, base_s: float, max_s: float) -> float:
        """Eject after a timeout or failure: skipped for base_s, doubling with each failure
        in a row, at most max_s. Returns the back-off."""
        self.failures += 1
        backoff = min(max_s, base_s * 2 ** min(self.failures - 1, 32))
        self.ejected_until = now + backoff
        return backoff

    def succeed(self) -> None:
        self.failures = 0

    def queue_depth(self) -> float:
        """Requests on the pod: the larger of what it reported and what this gateway has
        sent it since (the report lags by up to a scrape interval)."""
        return max(float(self.in_flight), self.load.running + self.load.waiting)

    def saturated(self, kv_threshold: float) -> bool:
        """Requests are waiting while the KV cache is nearly full: more would queue."""
        return self.load.waiting > 0 and self.load.kv_usage >= kv_threshold


def parse_load(text: str, now: float) -> ReplicaLoad:
    """The load gauges from a Prometheus text exposition (summed over label sets); requests
    preempted back into a pod's queue count as waiting."""
    values = {RUNNING: 0.0, WAITING: 0.0, PREEMPTED: 0.0, KV_USAGE: 0.0}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = len(line)
        for i, ch in enumerate(line):
            if ch in "{ ":
                name_end = i
                break
        name = line[:name_end]
        if name not in values:
            continue
        rest = line[line.rfind("}") + 1:] if line[name_end:name_end + 1] == "{" else line[name_end:]
        try:  # `value [timestamp]`
            values[name] += float(rest.split()[0])
        except (IndexError, ValueError):
            continue
    return ReplicaLoad(running=values[RUNNING], waiting=values[WAITING] + values[PREEMPTED],
                       kv_usage=values[KV_USAGE],
                       scraped_at=now)
