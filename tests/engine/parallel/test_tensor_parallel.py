"""Tensor and pipeline parallelism on the CPU (gloo, one process per rank): the same greedy
tokens as one process with chunked prefill, prefix caching and preemption active; the
sharded load's bytes per rank; no process outlives the engine; a rank that dies fails
/health and ends the server with code 1 within seconds."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess

import httpx
import pytest

from kvpilot.engine.llm import LLM
from kvpilot.engine.config.model import ModelConfig
from kvpilot.engine.loader.source import resolve_model
from kvpilot.engine.core.sampling_params import SamplingParams
from kvpilot.engine.tiny.model import make_tiny_model

from server_harness import ServerProcess, wait_for

MAX_NEW = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The trained tiny Llama, and a random Qwen2-style model (q/k/v biases, a vocabulary
    of 1001 that no rank count divides: the padded vocabulary shards)."""
    qwen2 = make_tiny_model(tmp_path_factory.mktemp("tp") / "qwen2", arch="qwen2", layers=3, hidden=128,
                            heads=4, kv_heads=2, intermediate=192, vocab=1001, seed=3)
    return {"tiny-trained": resolve_model("builtin:tiny-trained"), "qwen2": qwen2}


@pytest.fixture(scope="module")
def prompts(models):
    rng = random.Random(0)
    shared = [rng.randrange(10, 1000) for _ in range(40)]  # a prefix-cache hit for two prompts
    return [shared + [rng.randrange(10, 1000) for _ in range(9)],
            [rng.randrange(10, 1000) for _ in range(70)],
            shared + [rng.randrange(10, 1000) for _ in range(3)],
            [rng.randrange(10, 1000) for _ in range(5)] * 6,
            [rng.randrange(10, 1000) for _ in range(21)]]


def engine_args(model_dir) -> dict:
    """Chunked prefill (a 32-token budget), prefix caching, and a cache of 12 blocks of 16
    tokens for 5 requests of up to ~95 tokens: preemption."""
    per_token = ModelConfig.from_dir(model_dir).kv_bytes_per_token
    return dict(model=str(model_dir), dtype="float32", enable_prefix_caching=True, max_num_batched_tokens=32,
                max_model_len=128, kv_cache_memory=12 * 16 * per_token)


def run(model_dir, prompts, transport="shared memory", **parallel):
    os.environ["KVPILOT_PARALLEL_SHM"] = "0" if transport == "gloo" else "1"
    try:
        llm = LLM(**engine_args(model_dir), **parallel)
    finally:
        os.environ.pop("KVPILOT_PARALLEL_SHM")
    if parallel:
        assert f", {transport})" in llm.engine.runner.describe()
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
                            use_tqdm=False)
        stats = llm.engine.stats()
        pids = [p.pid for p in (llm.engine.runner.workers.processes if llm.engine.runner.workers else [])]
        reports = llm.engine.runner.rank_reports
    finally:
        llm.engine.shutdown()
    return [o.outputs[0].token_ids for o in outs], stats, pids, reports


@pytest.fixture(scope="module")
def baseline(models, prompts):
    return {name: run(path, prompts)[0] for name, path in models.items()}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie not yet reaped is gone too
        return f.read().split(") ")[1].startswith("Z")


@pytest.mark.parametrize("model, tp, pp, transport", [
    ("tiny-trained", 2, 1, "shared memory"), ("tiny-trained", 1, 2, "shared memory"),
    ("tiny-trained", 2, 2, "shared memory"),
    ("tiny-trained", 2, 1, "gloo"), ("tiny-trained", 1, 2, "gloo"),
    ("qwen2", 2, 1, "shared memory"), ("qwen2", 1, 2, "shared memory")])
def test_greedy_tokens_equal_one_process(models, prompts, baseline, model, tp, pp, transport):
    tokens, stats, pids, reports = run(models[model], prompts, transport, tensor_parallel_size=tp,
                                       pipeline_parallel_size=pp)
    assert tokens == baseline[model]
    assert stats.num_preemptions_total > 0, "the 12-block cache should have forced preemption"
    assert stats.prefix_cache_hits_total > 0
    assert stats.kv_cache_usage == 0.0
    assert len(reports) == tp * pp and len(pids) == tp * pp - 1
    cfg = ModelConfig.from_dir(models[model])
    assert sum(r["layers"] for r in reports) == cfg.num_hidden_layers * tp
    assert {r["kv_heads"] for r in reports} == {cfg.num_key_value_heads // tp}
    assert all(wait_for(lambda: _gone(pid), 10, what=f"rank pid {pid} gone") for pid in pids)
    if model == "tiny-trained" and tp * pp == 2:  # the sharded load, on the engines started above
        _each_rank_read_its_share(models[model], reports)


def _each_rank_read_its_share(model_dir, reports) -> None:
    """Each rank reads its half of the checkpoint (plus the replicated norms and the header,
    < 1 %), for tp=2 and for pp=2 (formerly test_sharded_load_reads_a_rank_share_of_the_checkpoint,
    which started two engines of its own for it)."""
    size = os.path.getsize(model_dir / "model.safetensors")
    reads = [r["load_bytes_read"] for r in reports]
    assert all(0.45 * size < r < 0.55 * size for r in reads), (size, reads)
    assert size <= sum(reads) < 1.02 * size


def test_ngram_speculation_under_tensor_parallelism(models, prompts, baseline):
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    llm = LLM(**engine_args(models["tiny-trained"]), tensor_parallel_size=2, speculative_config=spec)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
                            use_tqdm=False)
        stats = llm.engine.stats()
    finally:
        llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == baseline["tiny-trained"]
    assert stats.spec_decode.num_accepted_tokens > 0


def test_a_rank_that_dies_fails_health_and_ends_the_server(tmp_path):
    server = ServerProcess(["--model", "builtin:tiny-trained", "--tensor-parallel-size", "2",
                            "--kv-cache-memory", "64Mi"], tmp_path / "serve.log")
    try:
        server.wait_ready()
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        worker = int(subprocess.check_output(["pgrep", "-P", str(server.pid), "-f", "kvpilot.engine.worker.rank"]).split()[0])
        os.kill(worker, signal.SIGKILL)
        code = wait_for(lambda: server.proc.poll(), 10, what="the server to exit after its rank died")
        assert code == 1, server.log_tail()
        log = server.log_tail()
        assert f"engine failed: rank 1 (pid {worker}) exited with code -9" in log, log
        assert "Traceback" not in log.split("engine failed")[-1]
    finally:
        server.stop()
