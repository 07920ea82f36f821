"""The chart's alerting rules, checked by the real promtool (built from the same Prometheus
module as the local cluster's server): `promtool check rules` on the rendered
PrometheusRule, then `promtool test rules` with tests/chart/alert_rules_test.yaml (each alert fires
for the pod that should, and not for its neighbour)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from go_tools import built_tool
from test_chart import by_kind, helm, render  # noqa: F401  (helm: a fixture)

TESTS = Path(__file__).resolve().parent / "alert_rules_test.yaml"


@pytest.fixture(scope="module")
def promtool() -> str:
    return built_tool("prometheus/build.sh", "promtool")


@pytest.fixture(scope="module")
def rules_dir(helm, tmp_path_factory) -> Path:  # noqa: F811
    (rule,) = by_kind(render(helm, "--api-versions", "monitoring.coreos.com/v1"))["PrometheusRule"]
    out = tmp_path_factory.mktemp("rules")
    (out / "rules.yml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    shutil.copy(TESTS, out / TESTS.name)
    return out


def test_promtool_checks_the_rules(promtool, rules_dir):
    proc = subprocess.run([promtool, "check", "rules", str(rules_dir / "rules.yml")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 7 rules found" in proc.stdout + proc.stderr


def test_promtool_unit_tests_every_alert(promtool, rules_dir):
    rules = yaml.safe_load((rules_dir / "rules.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    tested = {t["alertname"] for case in yaml.safe_load(TESTS.read_text())["tests"] for t in case["alert_rule_test"]}
    assert tested == alerts, f"alerts without a promtool test: {sorted(alerts - tested)}"
    proc = subprocess.run([promtool, "test", "rules", TESTS.name], cwd=rules_dir, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_thresholds_come_from_values(helm):  # noqa: F811
    (rule,) = by_kind(render(helm, "--api-versions", "monitoring.coreos.com/v1",
                             "--set-json", "prometheusRule.thresholds.queueTimeSeconds=2.5"))["PrometheusRule"]
    exprs = {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert exprs["KvpilotQueueTimeHigh"].rstrip().endswith("> 2.5")
