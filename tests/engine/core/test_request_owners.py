"""Request state by layer, checked structurally: each layer's per-request state object
(`req.kv`, `req.row`, `req.sample`, `req.spec`, `req.out`), the scheduler's own fields of
a Request, its timestamps and its user request (RequestGroup) are written only by the
modules that own them. The scan reads every engine
module's AST for assignments, augmented assignments, `del` and mutating calls (append,
extend, ...) whose target is such a field; a write through a local alias (`ids =
req.kv.block_ids; ids.append(...)`) is not seen, so owners read them through the state."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import kvpilot.engine
from kvpilot.engine.core.request import (
    KVState, OutputState, RequestGroup, RequestTimes, RowState, SampleState, SpecState,
)

ENGINE = Path(kvpilot.engine.__file__).parent
STATES = {"kv": KVState, "row": RowState, "sample": SampleState, "spec": SpecState, "out": OutputState,
          "times": RequestTimes, "group": RequestGroup}
FIELDS = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in STATES.items()}
# The scheduler's fields of the Request itself (the rest are fixed at add_request).
SCHEDULER_FIELDS = {"status", "num_computed_tokens", "num_cached_tokens", "num_preemptions",
                    "stop_reason", "output_token_ids"}
# Who may write what ("request" is the scheduler's fields; request.py's own methods, which
# only the scheduler calls, write through `self`).
OWNERS = {
    "kv": {"core/kv_cache_manager.py"},
    "row": {"worker/step_inputs.py"},
    "sample": {"sample/sampler.py"},
    "spec": {"spec_decode/speculator.py", "worker/draft_model.py"},
    "out": {"core/output_processor.py"},
    "group": {"core/output_processor.py"},  # built whole at add_request
    "request": {"core/scheduler.py", "core/request.py"},
    # Timestamps: the scheduler's admission and end; the engine's step stamps tokens as it
    # emits them; arrival is set when the request is made.
    "times": set(),
    "times.first_scheduled": {"core/scheduler.py"},
    "times.finished": {"core/scheduler.py"},
    "times.first_token": {"llm_engine.py"},
    "times.last_token": {"llm_engine.py"},
}


def _owners(key: str) -> set[str]:
    return OWNERS.get(key, OWNERS[key.split(".")[0]])
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "update", "sort", "reverse",
            "popleft", "appendleft"}


def _chain(node: ast.AST) -> list[str] | None:
    """`a.b.c[i]` -> ["a", "b", "c"]; None when the target is no attribute chain."""
    parts = []
    while True:
        if isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Name):
            parts.append(node.id)
            return parts[::-1] if len(parts) > 1 else None
        else:
            parts.append("?")  # a call or the like: what it returns
            return parts[::-1] if len(parts) > 1 else None


def _classify(chain: list[str], self_is_request: bool) -> str | None:
    """The state a written chain belongs to: "kv.block_ids", "kv" (the object rebound),
    "request.status"; None for anything else."""
    *base, last = chain
    # `req.kv.block_ids`, or through a local named for the state (`kv = req.kv`).
    if base and base[-1] in FIELDS and last in FIELDS[base[-1]]:
        return f"{base[-1]}.{last}"
    if last in FIELDS and base != ["self"]:
        return last
    if last in SCHEDULER_FIELDS and (base != ["self"] or self_is_request):
        return f"request.{last}"
    return None


def _targets(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                yield from (t.elts if isinstance(t, ast.Tuple) else [t])
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            yield node.target
        elif isinstance(node, ast.Delete):
            yield from node.targets
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in MUTATORS):
            yield node.func.value


def writes(source: str, self_is_request: bool = False) -> set[str]:
    """What a module's code writes of a request's state ("kv.block_ids", "request.status")."""
    found = set()
    for target in _targets(ast.parse(source)):
        chain = _chain(target)
        # The scheduler's field names are common words (a stream's num_cached_tokens): only
        # a write through a name that holds a Request counts for those.
        if chain is None:
            continue
        key = _classify(chain, self_is_request)
        if key is None:
            continue
        if key.startswith("request.") and chain[-2] not in ("req", "request", "r", "child", "victim", "self"):
            continue
        found.add(key)
    return found


def _engine_writes() -> dict[str, set[str]]:
    out = {}
    for path in sorted(ENGINE.rglob("*.py")):
        rel = path.relative_to(ENGINE).as_posix()
        out[rel] = writes(path.read_text(), self_is_request=rel == "core/request.py")
    return out


def test_each_layer_state_is_written_by_its_owner_only():
    foreign = sorted(f"{module} writes {key}" for module, keys in _engine_writes().items()
                     for key in keys if module not in _owners(key))
    assert not foreign, "a layer writes another's request state:\n" + "\n".join(foreign)


def test_the_scan_sees_each_owner_write_its_state():
    """The owners' writes are found (so an empty violation list means something)."""
    found = _engine_writes()
    assert {"kv.block_ids", "kv.num_hashed_blocks", "kv.version"} <= found["core/kv_cache_manager.py"]
    assert {"row.table_row", "row.num_table_blocks"} <= found["worker/step_inputs.py"]
    assert "sample.penalty_counts" in found["sample/sampler.py"]
    assert {"spec.token_ids", "spec.draft_num_computed"} <= found["spec_decode/speculator.py"]
    assert {"spec.token_ids", "spec.draft_probs", "spec.draft_num_computed"} <= found["worker/draft_model.py"]
    assert {"out.group", "out.completion", "out.detokenizer", "group.first_token_seen",
            "group.summary_recorded"} <= found["core/output_processor.py"]
    assert {"times.first_scheduled", "times.finished"} <= found["core/scheduler.py"]
    assert {"times.first_token", "times.last_token"} <= found["llm_engine.py"]
    assert {"request.status", "request.num_computed_tokens", "request.num_preemptions",
            "request.stop_reason"} <= found["core/scheduler.py"]
    assert {"request.output_token_ids", "request.stop_reason"} <= found["core/request.py"]


@pytest.mark.parametrize("line,key", [
    ("req.kv.block_ids = []", "kv.block_ids"),
    ("req.kv.block_ids.append(3)", "kv.block_ids"),
    ("del request.kv.block_ids[2:]", "kv.block_ids"),
    ("req.row.table_row, req.row.num_table_blocks = 1, 0", "row.table_row"),
    ("item.request.spec.token_ids = []", "spec.token_ids"),
    ("r.sample.penalty_counts.update([1])", "sample.penalty_counts"),
    ("child.out = None", "out"),
    ("req.out.group.children.append(req)", "group.children"),
    ("req.times.first_token = 1.0", "times.first_token"),
    ("req.status = 'x'", "request.status"),
    ("request.num_computed_tokens += 1", "request.num_computed_tokens"),
])
def test_the_scan_flags_each_kind_of_write(line, key):
    assert key in writes(f"def f(req, request, item, r, child):\n    {line}\n")


def test_the_scan_ignores_reads_and_other_objects():
    source = ("def f(req, track, self):\n"
              "    n = len(req.kv.block_ids)\n"
              "    track.num_cached_tokens = 3\n"  # a stream's counter, not a Request's
              "    self.status = 'ok'\n")
    assert writes(source) == set()
