"""Schemathesis against a live `kvpilot serve` (builtin:tiny on the CPU), from the server's
own /openapi.json: every operation, with bodies that fit the schema (positive) and bodies
that break it (negative). Every response must be below 500, every non-2xx in the OpenAI
envelope, every status one the schema declares, and every body that breaks the schema
refused. The number of cases run is printed (docs/server.md quotes it). The unit run
sends 8 examples per operation and mode; KVPILOT_FUZZ_EXAMPLES=30 runs the longer fuzz."""

from __future__ import annotations

import os
import signal
import time

import pytest

schemathesis = pytest.importorskip("schemathesis")  # in the `test` extra; a clear skip reason if absent
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    negative_data_rejection, status_code_conformance,
)

from server_harness import ServerProcess  # noqa: E402

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Every operation and both modes still run; more examples per pair is a longer fuzz, not a new check.
EXAMPLES_PER_OPERATION_AND_MODE = int(os.environ.get("KVPILOT_FUZZ_EXAMPLES", "8"))
MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    # max_model_len 64 keeps each generated answer short, so the run is about the edge.
    proc = ServerProcess(["--model", "builtin:tiny", "--served-model-name", "tiny",
                          "--max-model-len", "64", "--max-num-seqs", "16", "--kv-cache-memory", "16Mi",
                          "--api-key", KEY, "--max-queued-requests", "64"], tmp / "server.log")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop(signal.SIGKILL)


def _envelope_problem(response) -> str | None:
    if response.status_code < 300:
        return None
    try:
        err = response.json()["error"]
    except Exception:  # not JSON, or no "error": the finding itself
        return f"not an error envelope: {response.text[:200]!r}"
    if set(err) != {"message", "type", "param", "code"} or not err["message"]:
        return f"malformed envelope: {err!r}"
    return None


def test_schemathesis_finds_no_5xx_and_every_error_is_in_the_envelope(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    statuses: dict[int, int] = {}
    problems: list[str] = []
    answered: set[str] = set()  # operations that got at least one response
    start = time.monotonic()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions",
                                               "POST /tokenize", "POST /detokenize"}
    for op in operations:
        for mode in MODES:
            if mode is GenerationMode.NEGATIVE and not len(op.body):
                continue  # a GET without parameters has nothing to break

            @settings(max_examples=EXAMPLES_PER_OPERATION_AND_MODE, deadline=None, database=None,
                      derandomize=True,  # the same cases every run: a reproducible count
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                response = case.call(base_url=server.url, headers=AUTH, timeout=60)
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                answered.add(op.label)
                problem = _envelope_problem(response)
                if problem is not None:
                    problems.append(f"{op.label} ({mode}) {case.body!r}: {problem}")
                try:
                    case.validate_response(response, checks=[
                        not_a_server_error, status_code_conformance, negative_data_rejection])
                except AssertionError as exc:
                    problems.append(f"{op.label} ({mode}) {case.body!r}: {str(exc)[:400]}")

            run()
    cases = sum(statuses.values())
    print(f"\nschemathesis: {cases} cases over {len(operations)} operations in "
          f"{time.monotonic() - start:.0f} s; statuses {dict(sorted(statuses.items()))}")
    assert not problems, "\n".join(problems[:20])
    assert answered == {op.label for op in operations}  # fewer examples, still every operation
    assert not any(s >= 500 for s in statuses)
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0  # both sides of the edge were hit
