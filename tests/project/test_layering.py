"""The house's rules, held by tests: the import contracts (.importlinter, run by import-linter
as kopf runs its own), no import cycle between modules (in-function imports count), folders
and modules that stay small, and the operator, the gateway and the simulated engine running
where torch is not installed (`pip install kvpilot` has none)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"engine": "kvpilot.engine", "kernels": "kvpilot.kernels", "operator": "kvpilot.operator"}
MAX_MODULES_PER_FOLDER = 20
MAX_LINES_PER_MODULE = 400


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, name in PACKAGES.items():
        for f in (ROOT / folder).rglob("*.py"):
            parts = [*name.split("."), *f.relative_to(ROOT / folder).with_suffix("").parts]
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _imports(module: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Every kvpilot module `module` imports, at any depth of its code (lazy imports count)."""
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
    return (found & set(mods)) - {module}


def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(g[v] & g.keys()):
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
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_through_others():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_import_contracts_hold():
    """.importlinter: the engine never imports the operator, kernels never the engine, the
    engine's core no server/worker/torch, the operator and gateway no torch, the gateway none
    of the operator's internals, and no cycles between sibling subpackages."""
    lint = Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(lint), "--no-cache", str(ROOT / ".importlinter")], cwd="/",
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "Contracts: 6 kept, 0 broken." in r.stdout, r.stdout[-3000:]


def test_folders_hold_at_most_20_modules_and_modules_at_most_400_lines():
    folders: dict[Path, int] = {}
    long = {}
    for path in _modules().values():
        if path.name != "__init__.py":
            folders[path.parent] = folders.get(path.parent, 0) + 1
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES_PER_MODULE:
            long[str(path.relative_to(ROOT))] = lines
    crowded = {str(f.relative_to(ROOT)): n for f, n in folders.items() if n > MAX_MODULES_PER_FOLDER}
    assert crowded == {} and long == {}, (crowded, long)


# Modules that a torch-free install must import: the operator and the gateway whole, and the
# simulated engine's server path (simulated pods run the slim kvpilot/operator image).
WITHOUT_TORCH = ("torch", "triton", "safetensors", "numpy", "transformers")


def test_the_operator_gateway_and_simulated_engine_run_without_torch():
    code = f"""
import pkgutil, importlib, sys
for m in {WITHOUT_TORCH!r}:
    sys.modules[m] = None  # `import torch` now raises ImportError, as where it is not installed
import kvpilot.operator, kvpilot.engine
for pkg in ("operator", "engine.server", "engine.metrics", "engine.core", "engine.config",
            "engine.sim", "engine.fleet"):
    mod = importlib.import_module("kvpilot." + pkg)
    for info in pkgutil.walk_packages(mod.__path__, mod.__name__ + "."):
        importlib.import_module(info.name)
from kvpilot.engine import LLM, SamplingParams
llm = LLM(model=None, simulate={{"accelerator": "h100-80gb", "model": "llama-3.1-8b"}}, max_model_len=2048)
out = llm.generate(["hello"] * 2, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
