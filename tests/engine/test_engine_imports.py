"""The engine's import graph: never the operator, the core never the server, and the
engine imports without fastapi, kopf or torch (no cycles: tests/project/test_layering.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from test_layering import graph

ENGINE = Path(__file__).resolve().parents[2] / "engine"
# What `kvpilot.engine` and its core must import without (the server's, the operator's,
# the model's and the kernels' dependencies).
ABSENT = ("fastapi", "uvicorn", "kopf", "kubernetes", "torch", "triton", "transformers")
CORE = ["llm_engine", "core.scheduler", "core.kv_cache_manager", "core.block_pool",
        "core.output_processor", "core.request", "config.engine", "config.args", "cli"]


def _graph() -> dict[str, set[str]]:
    """The engine's part of kvpilot's import graph (tests/project/test_layering.py builds it,
    and checks it for cycles, in-function imports included)."""
    return {m: deps for m, deps in graph().items() if m.startswith("kvpilot.engine")}


def test_the_engine_never_imports_the_operator_and_its_core_never_the_server():
    graph = _graph()
    operator = {m: sorted(d for d in deps if d.startswith("kvpilot.operator"))
                for m, deps in graph.items()}
    assert {m: d for m, d in operator.items() if d} == {}
    for name in CORE:
        deps = graph[f"kvpilot.engine.{name}"]
        assert not {d for d in deps if d.startswith("kvpilot.engine.server")} - (
            {"kvpilot.engine.server.cli"} if name == "cli" else set()), name


def test_the_engine_and_its_core_import_without_the_server_operator_or_torch():
    names = ", ".join(f"kvpilot.engine.{m}" for m in CORE)
    code = (f"import sys\nfor m in {ABSENT!r}: sys.modules[m] = None\n"
            f"import kvpilot.engine, {names}\n"
            "from kvpilot.engine import LLM, EngineConfig, SamplingParams\n"
            "from kvpilot.engine.cli import build_parser\nbuild_parser()\nprint('imported')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "imported" in r.stdout, r.stderr


def test_the_server_reaches_the_engine_only_through_async_engine():
    """Only async_engine.py (the engine thread's owner) and cli.py (which builds the engine
    before the thread starts) may touch LLMEngine; handlers use AsyncEngine's methods."""
    graph = _graph()
    for f in sorted((ENGINE / "server").glob("*.py")):
        if f.name in ("async_engine.py", "cli.py", "__init__.py"):
            continue
        assert "kvpilot.engine.llm_engine" not in graph[f"kvpilot.engine.server.{f.stem}"], f.name
        assert ".engine.engine" not in f.read_text(), f.name
