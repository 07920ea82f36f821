"""The gateway's settings: one dataclass, validated once; `kvpilot gateway`'s flags are
generated from it."""
from __future__ import annotations

from dataclasses import dataclass, field

from .hashing import DEFAULT_LOAD_FACTOR
from .picker import DEFAULT_KV_SATURATION, POLICIES
from .prefix import DEFAULT_PREFIX_CHARS

MAX_BODY_BYTES_LIMIT = 1 << 30
METRICS_ACCESS = ("auto", "key", "open")


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
    first_byte_timeout: float = field(default=30.0, metadata={
        "help": "seconds a replica has to begin answering a streamed request (its headers, which an "
        "engine sends once the request is queued); then the replica is ejected and the request "
        "retried on another, or 504"})
    response_timeout: float = field(default=600.0, metadata={
        "help": "seconds a replica has to answer a non-streamed request (it answers when the whole "
        "completion is done); then as --first-byte-timeout"})
    stream_idle_timeout: float = field(default=120.0, metadata={
        "help": "longest silence between two chunks of a replica's answer once it began; then the "
        "stream ends with an error event and the replica is ejected"})
    eject_seconds: float = field(default=5.0, metadata={
        "help": "a replica that timed out, refused or failed is skipped this long, doubling with each "
        "failure in a row (passive outlier ejection)"})
    eject_max_seconds: float = field(default=120.0, metadata={"help": "the longest ejection"})
    engine_api_key_file: str | None = field(default=None, metadata={
        "help": "file holding the engines' API key (their --api-key), sent to replicas as `Authorization: "
        "Bearer`; a different thing from tenants' keys. Unset: $KVPILOT_ENGINE_API_KEY, else none"})
    metrics_access: str = field(default="auto", metadata={
        "choices": METRICS_ACCESS, "help": "who may read /metrics (it names tenants and models): key: "
        "only with `Authorization: Bearer` and the key in --metrics-key-file; open: anyone; auto: open "
        "when the gateway has no tenants (nothing there is private), else key"})
    metrics_key_file: str | None = field(default=None, metadata={
        "help": "file holding the key that reads /metrics (Prometheus' bearer token)"})
    header_read_timeout: float = field(default=10.0, metadata={
        "help": "seconds a connection has to deliver a request's headers; then it is closed (408)"})
    body_read_timeout: float = field(default=30.0, metadata={
        "help": "seconds a request has to deliver its body once its headers are in; then 408"})
    write_timeout: float = field(default=30.0, metadata={
        "help": "seconds a client may leave its response unread (the gateway's write buffer full) "
        "before it is dropped, freeing its slot and its replica's stream"})
    max_header_bytes: int = field(default=32 << 10, metadata={
        "help": "largest request line plus headers accepted (431 above)"})
    max_headers: int = field(default=100, metadata={"help": "most request headers accepted (431 above)"})
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
            "first_byte_timeout": 0 < self.first_byte_timeout <= 86400,
            "response_timeout": 0 < self.response_timeout <= 86400,
            "stream_idle_timeout": 0 < self.stream_idle_timeout <= 86400,
            "eject_seconds": 0 <= self.eject_seconds <= 86400,
            "eject_max_seconds": self.eject_seconds <= self.eject_max_seconds <= 86400,
            "header_read_timeout": 0 < self.header_read_timeout <= 3600,
            "body_read_timeout": 0 < self.body_read_timeout <= 3600,
            "write_timeout": 0 < self.write_timeout <= 3600,
            "max_header_bytes": 1024 <= self.max_header_bytes <= 1 << 20,
            "max_headers": 1 <= self.max_headers <= 10000,
            "refresh_interval": 0.05 <= self.refresh_interval <= 3600,
            "scrape_interval": 0.05 <= self.scrape_interval <= 3600,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')}: {getattr(self, name)!r} is out of range")
        if self.metrics_access not in METRICS_ACCESS:
            raise ValueError(f"--metrics-access must be one of {', '.join(METRICS_ACCESS)}, "
                             f"got {self.metrics_access!r}")
        if self.routing not in POLICIES:
            raise ValueError(f"--routing must be one of {', '.join(POLICIES)}, got {self.routing!r}")
