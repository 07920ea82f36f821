"""The autotuner: read a deployment's engine signals from Prometheus (prometheus.py),
plan capacity from the KV formula run backwards (capacity.py), decide with a pure
policy (policy.py) and report under status.autotune (report.py).

Each interval the operator calls, for one LLMDeployment:

    snap = reader.snapshot(namespace, name, window_s)
    plan = plan_capacity(seq_len=snap.request_len_p99 or settings.max_model_len, ...,
                         kv_cache_memory=snap.kv_cache_bytes, bytes_per_token=snap.kv_bytes_per_token)
    decision = decide(snap, settings, bounds, history, now, capacity=plan, thresholds=t)
    applied = mode == "Auto" and decision.changes_something   # and the apply succeeded
    history = history.record(decision, applied)
    status["autotune"] = build_report(decision, history, snap, plan).dump()

Nothing here imports kopf or kubernetes; prometheus_api_client is imported only by
PrometheusReader.from_url."""

from .capacity import TINY_FLOAT32, CapacityPlan, ModelShape, kv_cache_bytes, plan_capacity
from .decision import DEFAULT_THRESHOLDS, Action, Bounds, Decision, Diagnosis, Range, Settings, Thresholds
from .history import History, HistoryEntry
from .advice import prefix_cache_warning
from .policy import decide
from .prometheus.reader import PrometheusReader
from .prometheus.client import QueryClient
from .prometheus.queries import Target, build_queries
from .report import (TABLE_HEADER, AutotuneStatus, build_report, format_table_row,
                     history_from_status)
from .signals import PodSettings, MetricsSnapshot

__all__ = [
    "Action", "AutotuneStatus", "Bounds", "CapacityPlan", "DEFAULT_THRESHOLDS", "Decision",
    "Diagnosis", "History", "HistoryEntry", "ModelShape", "PodSettings", "PrometheusReader",
    "QueryClient", "Range", "Settings", "MetricsSnapshot", "TABLE_HEADER", "TINY_FLOAT32", "Target",
    "Thresholds", "build_queries", "build_report", "decide", "format_table_row",
    "history_from_status", "kv_cache_bytes", "prefix_cache_warning", "plan_capacity",
]
