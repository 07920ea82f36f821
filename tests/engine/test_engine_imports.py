"""The engine's import graph: no cycles, never the operator, the core never the server,
and the engine imports without fastapi, kopf or torch."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"
# What `kvpilot.engine` and its core must import without (the server's, the operator's,
# the model's and the kernels' dependencies).
ABSENT = ("fastapi", "uvicorn", "kopf", "kubernetes", "torch", "triton", "transformers")
CORE = ["llm_engine", "core.scheduler", "core.kv_cache_manager", "core.block_pool",
        "core.output_processor", "core.request", "config.engine", "config.args", "cli"]


def _modules() -> dict[str, Path]:
    mods = {}
    for f in ENGINE.rglob("*.py"):
        parts = ["kvpilot", "engine", *f.relative_to(ENGINE).with_suffix("").parts]
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _imports(module: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Every module `module` imports, at any depth of its code (lazy imports count too)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + (node.module.split(".") if node.module else []))
            submodules = {f"{target}.{a.name}" for a in node.names} & set(mods)
            # `from . import x` needs the package only as x's parent, which every import has.
            found.update(submodules or {target})
    return found - {module}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v] & graph.keys():
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                out.append(sorted([v, *component]))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_engine_has_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


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
