"""hf:// models against olah as air-gapped sites run it (tests/hub_server.py with
hub_compat=False: olah's own answers; only the token check and byte counter sit in front):
the revision pinned to a commit, the engine's files fetched and verified, the cache found
again, a killed download resumed, the failures named, and the engine loading the model."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("olah", reason="the Hub test server is olah (pip install -e '.[test]')")

from kvpilot.engine.fetch.base import (CHECKSUM_MISMATCH, REPOSITORY_NOT_FOUND, REVISION_NOT_FOUND,  # noqa: E402
                                        UNAUTHORIZED, Listing, ModelFetchError, RemoteFile)
from kvpilot.engine.fetch.download import FetchOptions, _verify, cached_snapshot, fetch  # noqa: E402
from kvpilot.engine.fetch.uri import parse_source  # noqa: E402
from hub_server import HubServer  # noqa: E402

TOKEN = "hf_kvpilot_test_token"
REPO = "acme/tiny-llama"


def shard(model_dir: Path) -> None:
    """model.safetensors -> two shards and their index, as large checkpoints come."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(model_dir / "model.safetensors")
    names = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in files.items():
        save_file({n: tensors[n] for n in part}, model_dir / file, metadata={"format": "pt"})
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: file for file, part in files.items() for n in part}}))
    (model_dir / "model.safetensors").unlink()


@pytest.fixture(scope="module")
def revisions(tmp_path_factory, tiny_model_dir):
    """v1: the tiny model in two shards, plus files the engine never reads; v2: a changed
    config.json."""
    root = tmp_path_factory.mktemp("hub-src")
    v1, v2 = root / "v1", root / "v2"
    shutil.copytree(tiny_model_dir, v1)
    shard(v1)
    (v1 / "pytorch_model.bin").write_bytes(os.urandom(1024))
    (v1 / "README.md").write_text("# tiny\n")
    shutil.copytree(v1, v2)
    config = json.loads((v2 / "config.json").read_text())
    (v2 / "config.json").write_text(json.dumps({**config, "kvpilot_revision": 2}))
    return v1, v2


@pytest.fixture(scope="module")
def hub(revisions):
    with HubServer({REPO: list(revisions)}, token=TOKEN, hub_compat=False) as server:
        yield server


def options(hub, cache: Path, token=TOKEN, **kw) -> FetchOptions:
    return FetchOptions(models_dir=cache, hub_endpoint=hub.endpoint, hub_token=token, interval_s=0.05, **kw)


def test_a_revision_is_pinned_to_its_commit_and_fetched_once(hub, revisions, tmp_path):
    main = hub.commit(REPO, "main")
    before = hub.bytes_served()
    result = fetch(f"hf://{REPO}", options(hub, tmp_path))
    assert result.revision == main and result.path.name == main
    names = sorted(p.name for p in result.path.iterdir())
    assert "pytorch_model.bin" not in names and "README.md" not in names and ".cache" not in names
    assert json.loads((result.path / "config.json").read_text())["kvpilot_revision"] == 2
    shard2 = "model-00002-of-00002.safetensors"
    assert (result.path / shard2).read_bytes() == (revisions[1] / shard2).read_bytes()
    assert hub.bytes_served() - before == result.total_bytes == result.downloaded
    assert cached_snapshot(f"hf://{REPO}", tmp_path) == result.path  # refs/main, offline
    served = hub.bytes_served()
    assert fetch(f"hf://{REPO}@main", options(hub, tmp_path)).downloaded == 0 and hub.bytes_served() == served
    v1 = fetch(f"hf://{REPO}@v1", options(hub, tmp_path))
    assert v1.revision == hub.commit(REPO, "v1") != main
    assert "kvpilot_revision" not in json.loads((v1.path / "config.json").read_text())
    pinned = fetch(f"hf://{REPO}@{v1.revision}", options(hub, tmp_path))
    assert pinned.path == v1.path and pinned.downloaded == 0


def test_the_failures_are_named(hub, tmp_path):
    cases = [(f"hf://{REPO}@no-such-branch", TOKEN, REVISION_NOT_FOUND, "revision 'no-such-branch' does not exist"),
             (f"hf://{REPO}@{'f' * 40}", TOKEN, REVISION_NOT_FOUND, "does not exist"),
             ("hf://acme/no-such-model", TOKEN, REPOSITORY_NOT_FOUND, "no such repository"),
             (f"hf://{REPO}", "hf_wrong", UNAUTHORIZED, "refused the request with the token given (HTTP 401)")]
    for source, token, reason, words in cases:
        with pytest.raises(ModelFetchError) as e:
            fetch(source, options(hub, tmp_path, token=token))
        assert e.value.reason == reason and words in str(e.value), (source, str(e.value))
        assert hub.endpoint in str(e.value)


def test_a_file_that_does_not_match_its_checksum_is_refused_and_removed(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    listing = Listing("k", (RemoteFile("config.json", 2, git_sha1="0" * 40),))
    with pytest.raises(ModelFetchError) as e:
        _verify(parse_source("hf://a/b"), listing, tmp_path)
    assert e.value.reason == CHECKSUM_MISMATCH and "git-sha1" in str(e.value)
    assert not (tmp_path / "config.json").exists()


def test_a_killed_download_resumes(hub, tmp_path):
    """`kvpilot fetch-model` SIGKILLed 60% of the way through a throttled download (the first
    shard whole, the second begun); the next run fetches only what is missing. olah's
    local-mirror mode answers a Range request with the whole file, so here the shard that was
    cut short starts over (against the Hub or S3, tests/engine/fetch/test_model_fetch_s3.py, it resumes
    from its last byte)."""
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": TOKEN, "KVPILOT_CACHE_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "kvpilot.engine.cli", "fetch-model", f"hf://{REPO}@v1", "--json-progress",
           "--interval", "0.1"]
    hub.set_throttle(4 * 1024 * 1024)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd="/")
        deadline = time.monotonic() + 120
        total = None
        for line in proc.stdout:
            p = json.loads(line)
            total = p["total"] or total
            if p["phase"] == "Downloading" and p["done"] > 0.6 * p["total"]:
                proc.send_signal(signal.SIGKILL)
                break
            assert time.monotonic() < deadline, "no progress past 60%"
        proc.wait(timeout=30)
    finally:
        hub.set_throttle(0)
    assert proc.returncode == -signal.SIGKILL
    before = hub.bytes_served()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/", timeout=120)
    assert done.returncode == 0, done.stderr
    final = json.loads(done.stdout.strip().splitlines()[-2])
    assert final["phase"] == "Ready" and final["total"] == total
    assert 0 < hub.bytes_served() - before < 0.55 * total  # the second shard, not the first again


def test_the_engine_serves_an_hf_model_and_a_pinned_one_offline(hub, tmp_path, monkeypatch, tiny_model_dir):
    from kvpilot.engine.llm import LLM
    from kvpilot.engine.core.sampling_params import SamplingParams

    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    expected = LLM(model=str(tiny_model_dir), max_model_len=128).generate(["hi"], params, use_tqdm=False)
    commit = hub.commit(REPO, "v1")
    got = LLM(model=f"hf://{REPO}@{commit}", max_model_len=128).generate(["hi"], params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    monkeypatch.setenv("KVPILOT_MODEL_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    offline = LLM(model=f"hf://{REPO}@{commit}", max_model_len=128).generate(["hi"], params, use_tqdm=False)
    assert offline[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    with pytest.raises(ModelFetchError, match="not in the cache"):
        LLM(model=f"hf://{REPO}@main", max_model_len=128)
