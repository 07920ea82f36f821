"""hf:// and s3:// sources parsed at the edge, the files a model needs, the cache's layout
and the one-line errors (no space, not cached, a malformed source)."""
from __future__ import annotations

import shutil
from collections import namedtuple

import pytest

from kvpilot.engine.fetch.base import NO_SPACE, UNREACHABLE, Listing, ModelFetchError, RemoteFile
from kvpilot.engine.fetch.cache import source_dirs
from kvpilot.engine.fetch.download import FetchOptions, _download
from kvpilot.engine.loader.source import resolve_model
from kvpilot.engine.fetch.uri import FileSelection, HubSource, S3Source, parse_source


def test_sources_parse_with_their_defaults():
    assert parse_source("hf://meta-llama/Llama-3.1-8B") == HubSource("meta-llama/Llama-3.1-8B", "main")
    assert parse_source("hf://org/m@v1.0").revision == "v1.0"
    assert parse_source("hf://org/m@" + "a" * 40).pinned
    assert parse_source("s3://models/llama/8b/") == S3Source("models", "llama/8b")
    assert parse_source("s3://models").uri == "s3://models"


@pytest.mark.parametrize("bad", ["hf://org", "hf://org/", "hf://a/b/c", "hf://org/x@", "hf://org/x@a b",
                                 "hf://org/x@a..b", "hf://-org/x", "s3://ab", "s3://Bucket/x",
                                 "s3://models//x", "s3://models/a/../b", "gs://models/x"])
def test_malformed_sources_name_the_model_field(bad):
    with pytest.raises(ValueError, match="model="):
        parse_source(bad)


def test_only_what_the_engine_reads_unless_asked():
    names = ["config.json", "tokenizer.json", "model-00001-of-00002.safetensors",
             "model.safetensors.index.json", "pytorch_model.bin", "consolidated.pth", "README.md",
             "original/params.json", "original/consolidated.00.pth", "onnx/model.safetensors", ".gitattributes"]
    assert FileSelection().select(names) == ["config.json", "model-00001-of-00002.safetensors",
                                             "model.safetensors.index.json", "tokenizer.json"]
    assert "original/consolidated.00.pth" in FileSelection(("original/*",)).select(names)
    assert "pytorch_model.bin" in FileSelection(("*.bin",)).select(names)


def test_cache_layout(tmp_path):
    hf = source_dirs(tmp_path, parse_source("hf://org/name@main"))
    assert hf.snapshot("abc") == tmp_path / "hf" / "org--name" / "snapshots" / "abc"
    s3 = source_dirs(tmp_path, parse_source("s3://b-1/p/q"))
    assert s3.partial("k") == tmp_path / "s3" / "b-1" / "p/q" / "partial" / "k"


def test_a_download_that_cannot_fit_is_refused_before_a_byte(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    source = parse_source("s3://models/big")
    listing = Listing("k", (RemoteFile("config.json", 10), RemoteFile("model.safetensors", 5 * 2**30)))
    with pytest.raises(ModelFetchError) as e:
        _download(source, listing, source_dirs(tmp_path, source), FetchOptions(models_dir=tmp_path), None, None)
    assert e.value.reason == NO_SPACE and "5.00 GiB still to download but only" in str(e.value)


def test_a_cache_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    import kvpilot.engine.fetch.download as model_fetch
    monkeypatch.setattr(model_fetch, "_listing", lambda source, options: Listing(
        "k", (RemoteFile("config.json", 2),), ("latest",)))
    cache = tmp_path / "ro"
    cache.mkdir(mode=0o555)
    monkeypatch.setattr(model_fetch, "exclusive", _raising(PermissionError(13, "Permission denied", str(cache))))
    with pytest.raises(ModelFetchError) as e:
        model_fetch.fetch("s3://models/x", FetchOptions(models_dir=cache))
    assert e.value.reason == "CacheError" and "Permission denied" in str(e.value)


def _raising(exc):
    def fail(*args, **kwargs):
        raise exc
    return fail


def test_offline_without_the_model_in_the_cache_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KVPILOT_MODEL_OFFLINE", "1")
    with pytest.raises(ModelFetchError, match="not in the cache"):
        resolve_model("s3://models/tiny")
    with pytest.raises(ValueError, match="model='hf://org'"):
        resolve_model("hf://org")
    monkeypatch.delenv("KVPILOT_MODEL_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(ModelFetchError) as e:
        resolve_model("hf://org/name@main")
    assert e.value.reason == UNREACHABLE and "cannot reach http://127.0.0.1:9" in str(e.value)
    with pytest.raises(ValueError, match="interval"):
        FetchOptions(models_dir=tmp_path, interval_s=0)
