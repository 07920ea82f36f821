"""The gateway's settings: one dataclass, validated once; `kvpilot gateway`'s flags are
generated from it."""
from __future__ import annotations

from dataclasses import dataclass, field

from .hashing import DEFAULT_LOAD_FACTOR
from .picker import DEFAULT_KV_SATURATION, POLICIES
from .prefix import DEFAULT_PREFIX_CHARS

MAX_BODY_BYTES_LIMIT = 1 << 30


@dataclass
class GatewaySettings:
    host: str = field(default="0.0.0.0", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "the OpenAI endpoint's port (also /metrics, /health)"})
    routing: str = field(default="prefix", metadata={
        "choices": POLICIES, "help": "prefix: consistent hashing of the prompt's start with bounded "
        "loads; least-loaded: fewest requests on the pod; round-robin"})
    load_factor: float = field(default=DEFAULT_LOAD_FACTOR, metadata={
        "help": "prefix routing's load bound: a replica takes at most load-factor x the mean load "
        "(+1) before a prefix spills to the next replica on the ring"})
    prefix_chars: int = field(default=DEFAULT_PREFIX_CHARS, metadata={
        "help": "characters of the prompt's start that form its routing key"})
    kv_saturation: float = field(default=DEFAULT_KV_SATURATION, metadata={
        "help": "a replica with waiting requests and KV-cache usage at or above this is passed over"})
    per_replica_concurrency: int = field(default=256, metadata={
        "help": "requests in flight per ready replica before the gateway queues by tenant priority"})
    queue_timeout: float = field(default=60.0, metadata={
        "help": "seconds a request may wait in the gateway's queue (or for a replica of a model at "
        "zero) before a 503"})
    scale_from_zero_timeout: float = field(default=300.0, metadata={
        "help": "seconds a request for a deployment at zero replicas is held while it scales to one "
        "and its pod starts, before a 503"})
    retries: int = field(default=2, metadata={
        "help": "other replicas to try after a connection error or a 503 (never once a response began)"})
    connect_timeout: float = field(default=2.0, metadata={"help": "seconds to connect to a replica"})
    max_body_bytes: int = field(default=32 << 20, metadata={"help": "largest request body accepted (413 above)"})
    tenants_file: str | None = field(default=None, metadata={
        "help": "YAML file of tenants (API key files, models, limits, priority); unset: open gateway"})
    refresh_interval: float = field(default=1.0, metadata={
        "help": "seconds between listings of LLMDeployments and their pods"})
    scrape_interval: float = field(default=1.0, metadata={
        "help": "seconds between reads of each replica's /metrics (its running/waiting/KV usage)"})
    log_prompts: bool = field(default=False, metadata={
        "help": "include the prompt's text in the request log (off: only model, tenant, sizes, timing)"})
    backend: list[str] = field(default_factory=list, metadata={"flag": False})
    namespace: list[str] = field(default_factory=list, metadata={"flag": False})

    def __post_init__(self) -> None:
        checks = {
            "port": 0 <= self.port <= 65535, "load_factor": 1 <= self.load_factor <= 100,
            "prefix_chars": 1 <= self.prefix_chars <= 1 << 20, "kv_saturation": 0 < self.kv_saturation <= 1,
            "per_replica_concurrency": 1 <= self.per_replica_concurrency <= 1 << 20,
            "queue_timeout": 0 < self.queue_timeout <= 86400, "retries": 0 <= self.retries <= 16,
            "scale_from_zero_timeout": 0 < self.scale_from_zero_timeout <= 86400,
            "connect_timeout": 0 < self.connect_timeout <= 600,
            "max_body_bytes": 1 <= self.max_body_bytes <= MAX_BODY_BYTES_LIMIT,
            "refresh_interval": 0.05 <= self.refresh_interval <= 3600,
            "scrape_interval": 0.05 <= self.scrape_interval <= 3600,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')}: {getattr(self, name)!r} is out of range")
        if self.routing not in POLICIES:
            raise ValueError(f"--routing must be one of {', '.join(POLICIES)}, got {self.routing!r}")
