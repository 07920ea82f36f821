"""The operator's own Prometheus metrics (separate from the engine's)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter("kvpilot_operator_reconciles_total", "Reconcile passes by trigger and result",
                     ["trigger", "result"])
ERRORS = Counter("kvpilot_operator_reconcile_errors_total", "Failed reconcile passes by reason", ["reason"])
DURATION = Histogram("kvpilot_operator_reconcile_duration_seconds", "Duration of reconcile passes",
                     buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30))
# Per deployment (llmdeployment_namespace, not `namespace`, which a pod scrape sets to the
# operator's own): the dashboard's annotations and the revert alert read it per deployment.
AUTOTUNE_DECISIONS = Counter("kvpilot_operator_autotune_decisions_total",
                             "Autotuner changes applied (Auto mode), by deployment, action (change|revert) "
                             "and setting", ["llmdeployment_namespace", "llmdeployment", "action", "setting"])
AUTOTUNE_DIAGNOSES = Counter("kvpilot_operator_autotune_diagnoses_total",
                             "Autotuner intervals by diagnosis", ["diagnosis"])
AUTOTUNE_WARNINGS = Counter("kvpilot_operator_autotune_warnings_total",
                            "Diagnose-only autotuner warnings raised, by reason", ["reason"])
LEADER = Gauge("kvpilot_operator_leader",
               "1 while this operator process holds the leader-election Lease (and reconciles), else 0")
PROMETHEUS_QUERIES = Counter("kvpilot_operator_prometheus_queries_total",
                             "Prometheus queries the autotuner made, by reader (deployment|fleet) and outcome",
                             ["reader", "outcome"])
PROMETHEUS_QUERY_DURATION = Histogram("kvpilot_operator_prometheus_query_duration_seconds",
                                      "Duration of the autotuner's Prometheus queries, by reader", ["reader"],
                                      buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10))
RESYNC_PASSES = Histogram("kvpilot_operator_resync_duration_seconds",
                          "Duration of a resync pass over every LLMDeployment (list to last reconcile done)",
                          buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
# Started minus completed (the histogram's _count) is the passes in flight: a pass does
# not wait for the previous one's stragglers, so under a backlog several overlap.
RESYNC_PASSES_STARTED = Counter("kvpilot_operator_resync_passes_started_total",
                                "Resync passes started (each lists every LLMDeployment and submits those "
                                "not already in flight)")
RESYNC_SKIPPED = Counter("kvpilot_operator_resync_skipped_total",
                         "LLMDeployments a resync pass skipped, by reason (in_flight: its previous pass is "
                         "still queued or running; locked: an event-triggered pass holds its lock)", ["reason"])
RECONCILES_IN_FLIGHT = Gauge("kvpilot_operator_reconciles_in_flight",
                             "Resync reconciles queued or running now")
RECONCILE_QUEUE_WAIT = Histogram("kvpilot_operator_reconcile_queue_seconds",
                                 "Time a resync reconcile waited for a worker (the concurrency bound)",
                                 buckets=(0.001, 0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60))
RECONCILE_CONCURRENCY = Histogram("kvpilot_operator_reconcile_concurrency",
                                  "Resync reconciles running at the moment one starts (itself included)",
                                  buckets=(1, 2, 4, 8, 16, 32, 64))
API_REQUESTS = Counter("kvpilot_operator_api_requests_total",
                       "Kubernetes API requests the reconciles made (not kopf's own watches), by method",
                       ["method"])
API_REQUESTS_SKIPPED = Counter("kvpilot_operator_api_requests_skipped_total",
                               "Applies and deletes not sent because they would change nothing "
                               "(the object is as this process last wrote it), by method", ["method"])
