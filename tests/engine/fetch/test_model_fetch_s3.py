"""s3:// models against a real S3 server (gofakes3, tests/s3_server.py): what is fetched,
the cache found again without a byte served, a crash resumed with a Range GET, two
processes sharing a cache downloading once, the failures named, progress reported, the
`kvpilot fetch-model` command, and the engine loading the same model offline."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvpilot.engine.fetch.base import BUCKET_NOT_FOUND, FILES_MISSING, NOT_CACHED, ModelFetchError
from kvpilot.engine.fetch.cache import source_dirs
from kvpilot.engine.fetch.download import FetchOptions, cached_snapshot, fetch, require_cached
from kvpilot.engine.fetch.uri import FileSelection, parse_source
from kvpilot.engine.fetch.s3 import S3Options
from s3_server import S3Server

BIG = 3 * 1024 * 1024


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_model_dir):
    d = tmp_path_factory.mktemp("s3model")
    shutil.copytree(tiny_model_dir, d, dirs_exist_ok=True)
    (d / "pytorch_model.bin").write_bytes(b"pickled weights are never fetched by default")
    (d / "original").mkdir()
    (d / "original" / "params.json").write_text("{}")
    return d


@pytest.fixture(scope="module")
def s3(model_dir, tmp_path_factory):
    with S3Server() as server:
        server.upload_dir("models", "tiny/v1", model_dir)
        blob = tmp_path_factory.mktemp("blob")
        (blob / "model.safetensors").write_bytes(os.urandom(BIG))
        (blob / "tokenizer.json").write_text("{}")
        server.upload_dir("models", "no-config", blob)
        yield server


@pytest.fixture
def creds(s3, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_key)


def options(s3, cache: Path, **kw) -> FetchOptions:
    return FetchOptions(models_dir=cache, s3=S3Options(endpoint_url=s3.endpoint, region=s3.region, path_style=True),
                        interval_s=0.05, **kw)


def test_fetches_the_engine_files_once_then_finds_them_without_a_byte(s3, creds, tmp_path, model_dir):
    before = s3.bytes_served()
    first = fetch("s3://models/tiny/v1", options(s3, tmp_path))
    names = sorted(p.relative_to(first.path).as_posix() for p in first.path.rglob("*") if p.is_file())
    expected = sorted(p.name for p in model_dir.iterdir() if p.is_file() and p.suffix != ".bin")
    assert [n for n in names if not n.startswith(".kvpilot")] == expected  # no *.bin, no original/
    for name in expected:
        assert (first.path / name).read_bytes() == (model_dir / name).read_bytes()
    assert s3.bytes_served() - before == first.total_bytes == first.downloaded
    served = s3.bytes_served()
    again = fetch("s3://models/tiny/v1", options(s3, tmp_path))
    assert (again.path, again.downloaded) == (first.path, 0) and s3.bytes_served() == served
    assert cached_snapshot("s3://models/tiny/v1", tmp_path) == first.path
    with_extra = fetch("s3://models/tiny/v1", options(s3, tmp_path / "b",
                                                      selection=FileSelection(("*.bin", "original/*"))))
    assert (with_extra.path / "pytorch_model.bin").is_file() and (with_extra.path / "original/params.json").is_file()


def test_a_crashed_download_resumes_from_the_bytes_on_disk(s3, creds, tmp_path):
    listing_size = fetch("s3://models/tiny/v1", options(s3, tmp_path / "ref")).total_bytes
    # The crash: half of the weights in their .incomplete file, the rest not started.
    src = parse_source("s3://models/tiny/v1")
    ref = next((tmp_path / "ref").rglob("model.safetensors"))
    key = ref.parent.name
    partial = source_dirs(tmp_path / "cache", src).partial(key)
    partial.mkdir(parents=True)
    half = ref.stat().st_size // 2
    (partial / "model.safetensors.incomplete").write_bytes(ref.read_bytes()[:half])
    before = s3.bytes_served()
    result = fetch("s3://models/tiny/v1", options(s3, tmp_path / "cache"))
    assert (result.path / "model.safetensors").read_bytes() == ref.read_bytes()
    assert s3.bytes_served() - before == listing_size - half == result.downloaded


def test_two_processes_sharing_a_cache_download_once(s3, creds, tmp_path):
    s3.set_throttle(4 * 1024 * 1024)  # long enough that the second starts while the first runs
    try:
        before = s3.bytes_served()
        seen: dict[int, list[str]] = {0: [], 1: []}
        results = [None, None]

        def run(i):
            results[i] = fetch("s3://models/tiny/v1", options(s3, tmp_path, progress=lambda p: seen[i].append(p.phase)))

        threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert results[0].path == results[1].path
        assert s3.bytes_served() - before == results[0].total_bytes  # once, not twice
        assert sorted(r.downloaded for r in results) == [0, results[0].total_bytes]
        assert any("Waiting" in phases for phases in seen.values())
    finally:
        s3.set_throttle(0)


def test_progress_runs_from_resolving_to_ready_with_bytes(s3, creds, tmp_path):
    s3.set_throttle(8 * 1024 * 1024)
    reports = []
    try:
        fetch("s3://models/tiny/v1", options(s3, tmp_path, progress=lambda p: reports.append(p.dump())))
    finally:
        s3.set_throttle(0)
    phases = [r["phase"] for r in reports]
    assert phases[0] == "Resolving" and phases[-1] == "Ready" and "Downloading" in phases
    mid = [r for r in reports if r["phase"] == "Downloading" and 0 < r["done"] < r["total"]]
    assert mid and all(r["bytesPerSecond"] > 0 for r in mid[1:])
    assert reports[-1]["percent"] == 100.0


def test_failures_are_named(s3, creds, tmp_path):
    with pytest.raises(ModelFetchError) as e:
        fetch("s3://models/no-config", options(s3, tmp_path))
    assert e.value.reason == FILES_MISSING and "no config.json" in str(e.value)
    with pytest.raises(ModelFetchError) as e:
        fetch("s3://no-such-bucket/x", options(s3, tmp_path))
    assert e.value.reason == BUCKET_NOT_FOUND and "no-such-bucket" in str(e.value)
    with pytest.raises(ModelFetchError) as e:
        fetch("s3://models/nothing-here", options(s3, tmp_path))
    assert e.value.reason == FILES_MISSING and "found: nothing" in str(e.value)
    with pytest.raises(ModelFetchError) as e:
        require_cached("s3://models/tiny/v2", tmp_path)
    assert e.value.reason == NOT_CACHED


def _cli_env(s3, cache: Path) -> dict:
    return {**os.environ, "KVPILOT_CACHE_DIR": str(cache), "AWS_ACCESS_KEY_ID": s3.access_key,
            "AWS_SECRET_ACCESS_KEY": s3.secret_key, "AWS_ENDPOINT_URL": s3.endpoint, "AWS_REGION": s3.region,
            "KVPILOT_S3_PATH_STYLE": "1"}


def test_fetch_model_command_reports_json_and_a_termination_message(s3, tmp_path):
    term = tmp_path / "termination-log"
    proc = subprocess.run([sys.executable, "-m", "kvpilot.engine.cli", "fetch-model", "s3://models/tiny/v1",
                           "--json-progress", "--interval", "0.1", "--termination-log", str(term)],
                          capture_output=True, text=True, env=_cli_env(s3, tmp_path), timeout=120, cwd="/")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    progress = [json.loads(line) for line in lines[:-1]]
    assert progress[-1]["phase"] == "Ready" and Path(lines[-1]).is_dir()
    outcome = json.loads(term.read_text())
    assert outcome["reason"] == "Ready" and outcome["total"] == progress[-1]["total"] and outcome["files"] >= 3

    bad = subprocess.run([sys.executable, "-m", "kvpilot.engine.cli", "fetch-model", "s3://models/no-config",
                          "--termination-log", str(term)],
                         capture_output=True, text=True, env=_cli_env(s3, tmp_path), timeout=120, cwd="/")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "kvpilot fetch-model: error: s3://models/no-config: no config.json" in bad.stderr
    assert json.loads(term.read_text())["reason"] == FILES_MISSING


def test_the_engine_loads_the_fetched_model_then_runs_offline(s3, tmp_path, monkeypatch, tiny_model_dir):
    from kvpilot.engine.llm import LLM
    from kvpilot.engine.core.sampling_params import SamplingParams

    for k, v in _cli_env(s3, tmp_path).items():
        monkeypatch.setenv(k, v)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    remote = LLM(model="s3://models/tiny/v1", max_model_len=128).generate(["hello"], params, use_tqdm=False)
    local = LLM(model=str(tiny_model_dir), max_model_len=128).generate(["hello"], params, use_tqdm=False)
    assert remote[0].outputs[0].token_ids == local[0].outputs[0].token_ids
    # The operator's engine container: no credentials, no network, the cache alone.
    monkeypatch.setenv("KVPILOT_MODEL_OFFLINE", "1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    served = s3.bytes_served()
    offline = LLM(model="s3://models/tiny/v1", max_model_len=128).generate(["hello"], params, use_tqdm=False)
    assert offline[0].outputs[0].token_ids == local[0].outputs[0].token_ids and s3.bytes_served() == served
