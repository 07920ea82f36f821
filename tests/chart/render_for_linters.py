"""Write what issue 39's linters read into a folder: the chart with every option on
(chart.yaml, as test_kubeconform.py renders it), the engine objects the operator builds
for its sample specs (engine.yaml) and the examples (examples.yaml). Not part of the test
suite; docs/kubernetes.md says how to run kube-score and checkov on the result:

    .venv/bin/python tests/chart/render_for_linters.py /tmp/kvpilot-lint
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from test_chart import CHART, KUBE_VERSION, ROOT  # noqa: E402
from test_kubeconform import EVERY_OPTION, engine_objects  # noqa: E402


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    helm = subprocess.run([str(ROOT / "e2e" / "build-helm.sh")], capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]
    chart = subprocess.run([helm, "template", "kvpilot", str(CHART), "-n", "kvpilot-system",
                            "--kube-version", KUBE_VERSION, *EVERY_OPTION],
                           capture_output=True, text=True, check=True).stdout
    (out / "chart.yaml").write_text(chart)
    (out / "engine.yaml").write_text(yaml.safe_dump_all(engine_objects(), sort_keys=False))
    examples = [yaml.safe_load(p.read_text()) for p in sorted((ROOT / "examples").glob("*.yaml"))]
    (out / "examples.yaml").write_text(yaml.safe_dump_all(examples, sort_keys=False))
    print(out)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kvpilot-lint"))
