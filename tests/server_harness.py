"""Start a real `kvpilot serve` subprocess on a free port and wait for it (with a deadline).
Shared by the server and bench-serve tests."""

from __future__ import annotations

import atexit
import json
import shutil
import signal
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.bench.serve_process import ServeProcess, free_port  # noqa: F401  (free_port: re-exported)

START_DEADLINE_S = 180.0


class ServerProcess(ServeProcess):
    """A ServeProcess launched at construction (tests call wait_ready themselves), with the
    server's /metrics read as a flat dict."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        super().__init__(args, log_path, env)
        self.launch()

    def wait_ready(self, deadline_s: float = START_DEADLINE_S) -> None:
        super().wait_ready(deadline_s)

    def log_tail(self, n: int = 60) -> str:
        return super().log_tail(n)

    def metrics(self) -> dict[str, float]:
        """Every sample as `name{label=value,...}` (labels sorted) -> value, plus bare names
        summed over labels for the single-series ones."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}"] = s.value
                out[s.name] = out.get(s.name, 0.0) + s.value
        return out


def envelope(r: httpx.Response, status: int) -> dict:
    """The OpenAI error envelope of a response with `status`; no traceback in it."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text
    return err


def wait_for(predicate, deadline_s: float, interval: float = 0.1, what: str = "condition"):
    """Poll until predicate() is truthy; return its value or raise after the deadline."""
    deadline = time.monotonic() + deadline_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {deadline_s} s waiting for {what} (last: {last!r})")


# --- one server shared by the test modules that can share it ------------------------------

SHARED_MODEL = "tiny"
SHARED_API_KEY = "test-key-123"
SHARED_MAX_NUM_SEQS = 8
SHARED_MAX_MODEL_LEN = 2048
_shared: dict[str, ServerProcess] = {}

# A slow simulated accelerator for the server tests: every step takes ~20 ms whatever
# the batch (the tiny model's compute is nothing next to the fixed overhead), so a
# 400-token request runs for seconds, as on the CPU, and cancellation tests have time.
TEST_ACCELERATOR = {"name": "test-gpu", "memory_bytes": 8 * 2**30, "bandwidth": 1e12, "flops": 1e14,
                    "step_overhead_s": 0.02, "per_seq_overhead_s": 0.0, "reserved_bytes": 0,
                    "source": "kvpilot's server tests"}


def simulated_args(tmp: Path) -> list[str]:
    """`kvpilot serve` flags for builtin:tiny's shape (float32: 4 KiB of KV per token, its
    tokenizer) on the slow test accelerator."""
    acc = tmp / "test-gpu.json"
    acc.write_text(json.dumps(TEST_ACCELERATOR))
    return ["--simulate", str(acc), "--simulate-model", "builtin:tiny", "--dtype", "float32"]


def write_tuning(path: Path, **values) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(values))
    tmp.replace(path)  # atomic, like a ConfigMap's symlink swap


def shared_server(kind: str = "real") -> ServerProcess:
    """builtin:tiny served as `tiny` with an API key and a tuning file holding
    max_num_seqs=8, max_model_len=2048; started once per test session and kind (stopped at
    exit). kind "simulated": the same shape on the simulated test accelerator. Tests that
    change its settings put them back."""
    if kind in _shared and _shared[kind].proc.poll() is None:
        return _shared[kind]
    tmp = Path(tempfile.mkdtemp(prefix=f"kvpilot-serve-{kind}-"))
    tuning = tmp / "tuning.json"
    write_tuning(tuning, max_num_seqs=SHARED_MAX_NUM_SEQS, max_model_len=SHARED_MAX_MODEL_LEN)
    model = simulated_args(tmp) if kind == "simulated" else ["--model", "builtin:tiny"]
    proc = ServerProcess([
        *model, "--served-model-name", SHARED_MODEL, "--max-num-seqs", "32",
        "--max-model-len", "4096", "--kv-cache-memory", "64Mi", "--api-key", SHARED_API_KEY,
        "--tuning-file", str(tuning),
    ], tmp / "server.log")
    proc.tuning_file = tuning
    try:
        proc.wait_ready()
    except BaseException:
        proc.stop(signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _shared[kind] = proc
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # runs after the stop below (LIFO)
    atexit.register(proc.stop)
    return proc


def fail_preparing_requests(monkeypatch, prefix: str) -> None:
    """Makes building a step's inputs raise for every sequence whose id starts with `prefix`
    (its token slice is read there), as a bug or a bad value in one request would."""
    from kvpilot.engine.core.request import Request

    real_token_at = Request.token_at

    def token_at(self, start, end):
        if self.request_id.startswith(prefix):
            raise RuntimeError("injected failure while preparing the step")
        return real_token_at(self, start, end)

    monkeypatch.setattr(Request, "token_at", token_at)
