"""The chart README's values table is the one values.schema.json and values.yaml give."""
from __future__ import annotations

from chart_readme import README, generated, leaves, values_table


def test_the_values_table_is_in_sync():
    text = README.read_text()
    assert text == generated(text), "charts/kvpilot/README.md drifted; run: .venv/bin/python tests/chart_readme.py"


def test_every_value_is_described_and_listed():
    import json

    from chart_readme import CHART

    schema = json.loads((CHART / "values.schema.json").read_text())
    bare = [p for p, node in leaves(schema) if not node.get("description")]
    assert bare == []
    table = values_table()
    assert all(f"| `{p}` |" in table for p, _ in leaves(schema))
    assert "| `serviceMonitor.labels` | object | `{}` |" in table
