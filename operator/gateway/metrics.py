"""The gateway's Prometheus metrics, in its own registry (one per gateway instance)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvpilot_gateway_requests_total",
                                "Requests answered, by model, tenant and HTTP status", ["model", "tenant", "code"],
                                registry=r)
        self.routing = Counter("kvpilot_gateway_routing_decisions_total",
                               "Replica choices by model and reason (prefix: the prefix's own replica; "
                               "prefix_spill: the next one on the ring, the own one being at its load bound "
                               "or saturated; least_loaded; round_robin)", ["model", "reason"], registry=r)
        self.retries = Counter("kvpilot_gateway_retries_total",
                               "Requests sent again, by model and cause (to another replica: connect_error: "
                               "no connection, timeout: no first byte in time, unavailable: the pod answered "
                               "503, draining; to the same one: stale_connection: it closed a kept-alive "
                               "connection under the request)",
                               ["model", "cause"], registry=r)
        self.ejections = Counter("kvpilot_gateway_ejections_total",
                                 "Replicas ejected (skipped for a back-off), by model and cause (connect_error, "
                                 "timeout: no first byte in time; stream_timeout: silent mid-answer; "
                                 "stream_failed: lost mid-answer)", ["model", "cause"], registry=r)
        self.rate_limited = Counter("kvpilot_gateway_rate_limited_total",
                                    "Requests refused with 429, by tenant and limit (requests|tokens)",
                                    ["tenant", "limit"], registry=r)
        self.tokens = Counter("kvpilot_gateway_tokens_total",
                              "Tokens the engines reported in `usage`, by tenant, model and kind "
                              "(prompt|completion)", ["tenant", "model", "kind"], registry=r)
        self.queue_waiting = Gauge("kvpilot_gateway_queue_waiting",
                                   "Requests waiting in the gateway's queue for a slot, by model",
                                   ["model"], registry=r)
        self.held = Gauge("kvpilot_gateway_held_requests",
                          "Requests held for an LLMDeployment with no ready replica (scale from zero)",
                          ["llmdeployment_namespace", "llmdeployment"], registry=r)
        self.wakes = Counter("kvpilot_gateway_scale_from_zero_total",
                             "Times the gateway set an LLMDeployment at zero replicas to one, for a held "
                             "request", ["llmdeployment_namespace", "llmdeployment"], registry=r)
        self.queue_wait = Histogram("kvpilot_gateway_queue_wait_seconds",
                                    "Time a request waited in the gateway's queue, by model", ["model"],
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("kvpilot_gateway_request_duration_seconds",
                                  "Time from a request's arrival to its last byte, by model", ["model"],
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.replicas = Gauge("kvpilot_gateway_ready_replicas", "Ready replicas the gateway routes to, "
                              "by model", ["model"], registry=r)
