"""kvpilot's Grafana dashboard: the chart ships exactly what operator/manifests/dashboard.py builds,
as a ConfigMap Grafana's sidecar picks up, and every query in it (panels, variables,
annotations, with Grafana's variables substituted) parses in the real Prometheus
(promtool check rules)."""
from __future__ import annotations

import json
import re
import subprocess

import yaml

from kvpilot.operator.manifests.dashboard import build_dashboard
from test_alert_rules import promtool  # noqa: F401  (a fixture)
from test_chart import CHART, by_kind, helm, render  # noqa: F401  (helm: a fixture)

GRAFANA_VARIABLES = {"$namespace": ".*", "$llmdeployment": ".*", "$__rate_interval": "1m", "$__interval": "30s"}


def queries(dashboard: dict) -> list[str]:
    out = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    out += [a["expr"] for a in dashboard["annotations"]["list"]]
    for v in dashboard["templating"]["list"]:
        m = re.fullmatch(r"label_values\((.+), \w+\)", v.get("definition", ""))
        if m:
            out.append(m.group(1))
    return out


def test_the_charts_copy_is_the_built_dashboard():
    shipped = json.loads((CHART / "dashboards" / "kvpilot.json").read_text())
    assert shipped == build_dashboard(), ("charts/kvpilot/dashboards/kvpilot.json is stale: "
                                          "python -m kvpilot.operator.manifests.dashboard > charts/kvpilot/dashboards/kvpilot.json")


def test_panels_cover_the_fleet_the_service_the_engine_and_the_autotuner():
    d = build_dashboard()
    rows = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert [r.split(":")[0] for r in rows] == ["Fleet", "Service", "Engine", "Autotuner"]
    text = json.dumps(d)
    for metric in ("vllm:request_time_per_output_token_seconds_bucket", "vllm:num_preemptions_total",
                   "vllm:prefix_cache_hits_total", "kvpilot:max_num_seqs", "kvpilot_operator_autotune_diagnosis",
                   "kvpilot_operator_capacity_fit_seqs", "kvpilot_operator_autotune_decisions_total"):
        assert metric in text, metric
    ids = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in d["panels"]]
    assert len(ids) == len(set(ids)), "two panels at one place"


def test_the_chart_renders_it_for_grafanas_sidecar(helm):  # noqa: F811
    (cm,) = [c for c in by_kind(render(helm))["ConfigMap"] if c["metadata"]["name"].endswith("-dashboards")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["kvpilot.json"]) == build_dashboard()
    (cm,) = by_kind(render(helm, "--set", "grafanaDashboards.label=my_dashboards",
                           "--set", "grafanaDashboards.namespace=monitoring"))["ConfigMap"]
    assert cm["metadata"]["labels"]["my_dashboards"] == "1" and cm["metadata"]["namespace"] == "monitoring"
    assert "ConfigMap" not in by_kind(render(helm, "--set", "grafanaDashboards.enabled=false"))


def test_every_query_parses_in_prometheus(promtool, tmp_path):  # noqa: F811
    rules = []
    for i, expr in enumerate(queries(build_dashboard())):
        for var, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"a Grafana variable left unsubstituted: {expr}"
        rules.append({"record": f"kvpilot:dashboard_query_{i}", "expr": expr})
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(rules) >= 25
