"""kvpilot's Grafana dashboard, built here as data (one pure function) and shipped in the
chart (charts/kvpilot/dashboards/kvpilot.json, a ConfigMap for Grafana's dashboard
sidecar); `kvpilot dashboard` prints it and a test keeps the chart's copy equal to it.

Rows: the fleet (every LLMDeployment), one deployment's service against its objectives and
its engine's state, and the autotuner's view of it (diagnosis, the settings it moved, the
capacity plan), with every applied change and revert as an annotation. Engine series are
selected by the pod label Prometheus's labelmap makes of serving.kvpilot.dev/llmdeployment;
the operator's own series carry llmdeployment_namespace and llmdeployment."""
from __future__ import annotations

from .objects import INSTANCE_LABEL

POD_LABEL = "".join(c if c.isalnum() else "_" for c in INSTANCE_LABEL)  # as the autotuner reads it
ENGINE = f'namespace=~"$namespace", {POD_LABEL}=~"$llmdeployment"'
OPERATOR = 'llmdeployment_namespace=~"$namespace", llmdeployment=~"$llmdeployment"'
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
UID = "kvpilot-llmdeployments"


def _target(expr: str, legend: str, ref: str) -> dict:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref}


def _panel(title: str, targets: list[tuple[str, str]], *, unit: str = "short", x: int, y: int,
           w: int = 8, h: int = 8, description: str = "", kind: str = "timeseries") -> dict:
    return {"type": kind, "title": title, "description": description, "datasource": DATASOURCE,
            "gridPos": {"x": x, "y": y, "w": w, "h": h},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [_target(e, legend, chr(ord("A") + i)) for i, (e, legend) in enumerate(targets)]}


def _row(title: str, y: int) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
            "panels": []}


def _by_deployment(expr: str) -> str:
    return f"sum by (namespace, {POD_LABEL}) ({expr})"


def _quantile(q: float, histogram: str, window: str = "$__rate_interval") -> str:
    return (f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket{{{ENGINE}}}[{window}])))")


def fleet_row(y: int) -> list[dict]:
    legend = f"{{{{namespace}}}}/{{{{{POD_LABEL}}}}}"
    return [
        _row("Fleet", y),
        _panel("Output tokens/s", [(_by_deployment(f"rate(vllm:generation_tokens_total{{{ENGINE}}}[$__rate_interval])"),
                                     legend)], x=0, y=y + 1),
        _panel("Requests finished/s", [(_by_deployment(
            f"rate(vllm:request_success_total{{{ENGINE}}}[$__rate_interval])"), legend)], x=8, y=y + 1),
        _panel("KV cache usage (max over pods)", [(
            f"max by (namespace, {POD_LABEL}) (vllm:kv_cache_usage_perc{{{ENGINE}}})", legend)],
            unit="percentunit", x=16, y=y + 1),
    ]


def service_row(y: int) -> list[dict]:
    return [
        _row("Service: latency against the objectives", y),
        _panel("Time to first token", [(_quantile(0.5, "vllm:time_to_first_token_seconds"), "p50"),
                                       (_quantile(0.95, "vllm:time_to_first_token_seconds"), "p95")],
               unit="s", x=0, y=y + 1),
        _panel("Time per output token", [
            (_quantile(0.5, "vllm:request_time_per_output_token_seconds"), "p50"),
            (_quantile(0.95, "vllm:request_time_per_output_token_seconds"), "p95"),
            (f"max(kvpilot_operator_objective_seconds{{{OPERATOR}, objective=\"tpot\"}})", "objective")],
            unit="s", x=8, y=y + 1,
            description="Each request's mean gap between tokens (vLLM's TPOT), and spec.autotune.objectives.tpot"),
        _panel("Queue time", [(_quantile(0.5, "vllm:request_queue_time_seconds"), "p50"),
                              (_quantile(0.95, "vllm:request_queue_time_seconds"), "p95")],
               unit="s", x=16, y=y + 1),
    ]


def engine_row(y: int) -> list[dict]:
    return [
        _row("Engine: memory, batch and settings", y),
        _panel("KV cache usage", [(f"avg(vllm:kv_cache_usage_perc{{{ENGINE}}})", "mean"),
                                  (f"max(vllm:kv_cache_usage_perc{{{ENGINE}}})", "max")],
               unit="percentunit", x=0, y=y + 1),
        _panel("Preemptions/s", [(f"sum(rate(vllm:num_preemptions_total{{{ENGINE}}}[$__rate_interval]))",
                                  "preemptions")], x=8, y=y + 1,
               description="Requests evicted to free KV blocks: the first thing to look at (memory)"),
        _panel("Prefix cache hit rate", [(
            f"sum(rate(vllm:prefix_cache_hits_total{{{ENGINE}}}[$__rate_interval])) / "
            f"sum(rate(vllm:prefix_cache_queries_total{{{ENGINE}}}[$__rate_interval]))", "hit rate")],
            unit="percentunit", x=16, y=y + 1),
        _panel("Running and waiting", [(f"sum(vllm:num_requests_running{{{ENGINE}}})", "running"),
                                       (f"sum(vllm:num_requests_waiting{{{ENGINE}}})", "waiting")],
               x=0, y=y + 9),
        _panel("Settings in effect (as the pods report them)", [
            (f"max(kvpilot:max_num_seqs{{{ENGINE}}})", "max_num_seqs"),
            (f"max(kvpilot:max_model_len{{{ENGINE}}})", "max_model_len")], x=8, y=y + 9,
            description="What the engines run now; a gap with the operator's settings is TuningApplied=False"),
        _panel("Replicas", [(f"count(vllm:num_requests_running{{{ENGINE}}})", "serving pods"),
                            (f"max(kvpilot_operator_setting{{{OPERATOR}, setting=\"replicas\"}})", "wanted")],
               x=16, y=y + 9),
    ]


def autotuner_row(y: int) -> list[dict]:
    return [
        _row("Autotuner", y),
        _panel("Diagnosis", [(f"max by (diagnosis) (kvpilot_operator_autotune_diagnosis{{{OPERATOR}}}) > 0",
                              "{{diagnosis}}")], kind="state-timeline", x=0, y=y + 1, w=12,
               description="What the autotuner found limiting the deployment at each interval"),
        _panel("Settings the operator applies", [
            (f"max by (setting) (kvpilot_operator_setting{{{OPERATOR}}})", "{{setting}}")], x=12, y=y + 1, w=12),
        _panel("Capacity plan: sequences that fit vs max_num_seqs", [
            (f"max(kvpilot_operator_capacity_fit_seqs{{{OPERATOR}}})", "fit in the KV cache"),
            (f"max(kvpilot_operator_setting{{{OPERATOR}, setting=\"max_num_seqs\"}})", "max_num_seqs")],
            x=0, y=y + 9, w=12,
            description="The KV sizing formula run backwards on the pods' kvpilot:kv_cache_bytes"),
        _panel("Changes applied", [(
            f"sum by (action, setting) (increase(kvpilot_operator_autotune_decisions_total{{{OPERATOR}}}"
            "[$__rate_interval]))", "{{action}} {{setting}}")], kind="barchart", x=12, y=y + 9, w=12),
    ]


def _variable(name: str, label: str, query: str) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE, "refresh": 2,
            "query": {"query": query, "refId": name}, "definition": query,
            "includeAll": True, "multi": True, "allValue": ".*", "current": {}, "sort": 1}


def build_dashboard() -> dict:
    rows = [fleet_row(0), service_row(9), engine_row(18), autotuner_row(35)]
    changes = (f"changes(kvpilot_operator_autotune_decisions_total{{{OPERATOR}}}[$__interval]) > 0")
    return {
        "uid": UID, "title": "kvpilot: LLMDeployments", "tags": ["kvpilot", "vllm"],
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}},
            _variable("namespace", "Namespace", "label_values(vllm:num_requests_running, namespace)"),
            _variable("llmdeployment", "LLMDeployment",
                      f'label_values(vllm:num_requests_running{{namespace=~"$namespace"}}, {POD_LABEL})'),
        ]},
        "annotations": {"list": [{
            "name": "Autotuner changes", "datasource": DATASOURCE, "enable": True, "iconColor": "orange",
            "expr": changes, "step": "30s", "titleFormat": "{{action}} {{setting}}",
            "textFormat": "{{llmdeployment_namespace}}/{{llmdeployment}}", "useValueForTime": False,
        }]},
        "panels": [p for row in rows for p in row],
    }


if __name__ == "__main__":  # regenerates the chart's copy: python -m kvpilot.operator.manifests.dashboard > FILE
    import json

    print(json.dumps(build_dashboard(), indent=1, sort_keys=True))
