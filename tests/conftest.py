import os
import sys
from pathlib import Path

# Triton kernels run in Triton's CPU interpreter in the fast tests. The variable is
# read when triton is first imported, so it is set here, before any test module
# (or the engine's triton backend) can import triton. A GPU run can override it
# with TRITON_INTERPRET=0.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Under xdist each worker (and every server it starts) would run as many OpenMP threads as
# the machine has cores: N workers x N threads on N cores, where libgomp's threads spin and
# wait on one another. The cores are shared out instead; measured on the 2-core machine,
# a torch-heavy fifth of the suite on two workers took 76 s instead of 110 s. Read when
# torch first loads, so set before any test module imports it; an explicit setting wins.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores // _workers)))

import pytest  # noqa: E402

# The tests mirror the package, one folder per subpackage, and some share fakes by importing
# another test module by its basename (`from test_autotune_hook import FakeKube`): every test
# folder is on sys.path, as pytest's default import mode puts a module's own folder there.
# Basenames are unique across tests/ (pytest refuses duplicates in this mode anyway).
for _folder in sorted({p.parent for p in Path(__file__).parent.rglob("test_*.py")}):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """One model of the builtin:tiny shape (make-tiny-model defaults, seed 0) per session."""
    from kvpilot.engine.tiny.model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama") / "model")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """A small Qwen2 model (q/k/v biases, Qwen2 pre-tokenizer) per session."""
    from kvpilot.engine.tiny.model import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen2") / "model",
        arch="qwen2", layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=2048,
    )
