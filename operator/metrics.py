"""The operator's own Prometheus metrics (separate from the engine's)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter("kvpilot_operator_reconciles_total", "Reconcile passes by trigger and result",
                     ["trigger", "result"])
ERRORS = Counter("kvpilot_operator_reconcile_errors_total", "Failed reconcile passes by reason", ["reason"])
DURATION = Histogram("kvpilot_operator_reconcile_duration_seconds", "Duration of reconcile passes",
                     buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
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
