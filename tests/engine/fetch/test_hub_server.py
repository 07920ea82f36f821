"""The Hub-compatible test server (tests/hub_server.py: olah serving local git repositories)
against the real huggingface_hub client: what hf:// model sources will be fetched with."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path

import pytest

pytest.importorskip("olah", reason="the Hub test server is olah (pip install olah)")

from huggingface_hub import HfApi, hf_hub_download, snapshot_download  # noqa: E402
from huggingface_hub.errors import (  # noqa: E402
    EntryNotFoundError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from hub_server import HubServer  # noqa: E402

TOKEN = "hf_kvpilot_test_token"
REPO = "acme/tiny-model"
MODEL_BYTES = 2 * 1024 * 1024


@pytest.fixture(scope="module")
def revisions(tmp_path_factory) -> tuple[Path, Path]:
    """Two revisions of a made-up model: v1, then v2 (a different config.json)."""
    root = tmp_path_factory.mktemp("hub-src")
    weights = os.urandom(MODEL_BYTES)  # need not be a valid safetensors file here
    out = []
    for i, hidden in ((1, 8), (2, 16)):
        d = root / f"v{i}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": hidden}))
        (d / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"vocab": {"a": 0}}}))
        (d / "model.safetensors").write_bytes(weights)
        out.append(d)
    return out[0], out[1]


@pytest.fixture(scope="module")
def hub(revisions):
    with HubServer({REPO: list(revisions)}, token=TOKEN) as server:
        yield server


@pytest.fixture
def api(hub) -> HfApi:
    return HfApi(endpoint=hub.endpoint, token=TOKEN)


def download(hub, tmp_path, filename, **kw) -> Path:
    kw.setdefault("token", TOKEN)
    return Path(hf_hub_download(REPO, filename, endpoint=hub.endpoint, cache_dir=tmp_path / "cache", **kw))


def test_model_info_gives_the_commit_and_file_metadata(hub, api, revisions):
    src = revisions[1]
    info = api.model_info(REPO, revision="main", files_metadata=True)
    assert re.fullmatch(r"[0-9a-f]{40}", info.sha)
    assert info.sha == hub.commit(REPO) == hub.commit(REPO, "v2")
    assert api.model_info(REPO).sha == info.sha  # no revision: the default branch
    siblings = {s.rfilename: s for s in info.siblings}
    assert set(siblings) == {".gitattributes", "config.json", "tokenizer.json", "model.safetensors"}
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert siblings[name].size == (src / name).stat().st_size
    weights = siblings["model.safetensors"]
    assert weights.lfs is not None
    assert weights.lfs.sha256 == hashlib.sha256((src / "model.safetensors").read_bytes()).hexdigest()
    assert weights.lfs.size == MODEL_BYTES
    assert siblings["config.json"].lfs is None and re.fullmatch(r"[0-9a-f]{40}", siblings["config.json"].blob_id)


def test_downloads_are_the_exact_bytes(hub, tmp_path, revisions):
    src = revisions[1]
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert download(hub, tmp_path, name).read_bytes() == (src / name).read_bytes()

    only_json = Path(snapshot_download(REPO, endpoint=hub.endpoint, token=TOKEN, cache_dir=tmp_path / "snap",
                                       allow_patterns=["*.json"]))
    assert sorted(p.name for p in only_json.iterdir()) == ["config.json", "tokenizer.json"]
    for p in only_json.iterdir():
        assert p.read_bytes() == (src / p.name).read_bytes()
    assert only_json.name == hub.commit(REPO)  # the snapshot folder is the commit


def test_a_revision_pins_by_commit_sha_and_by_tag(hub, api, tmp_path, revisions):
    v1, v2 = hub.commit(REPO, "v1"), hub.commit(REPO, "main")
    assert re.fullmatch(r"[0-9a-f]{40}", v1) and v1 != v2
    assert api.model_info(REPO, revision=v1).sha == v1
    for rev in (v1, "v1"):
        path = download(hub, tmp_path / rev, "config.json", revision=rev)
        assert path.read_bytes() == (revisions[0] / "config.json").read_bytes()
    assert download(hub, tmp_path, "config.json").read_bytes() == (revisions[1] / "config.json").read_bytes()
    snap = Path(snapshot_download(REPO, revision=v1, endpoint=hub.endpoint, token=TOKEN,
                                  cache_dir=tmp_path / "snap", allow_patterns=["config.json"]))
    assert snap.name == v1
    assert json.loads((snap / "config.json").read_text())["hidden_size"] == 8


def test_missing_revision_repo_and_file(api, hub, tmp_path):
    for rev in ("no-such-branch", "0" * 40):
        with pytest.raises(RevisionNotFoundError) as e:
            api.model_info(REPO, revision=rev)
        assert e.value.response.status_code == 404
        with pytest.raises(RevisionNotFoundError):
            download(hub, tmp_path, "config.json", revision=rev)
    with pytest.raises(RepositoryNotFoundError) as e:
        api.model_info("acme/no-such-model", revision="main")
    assert e.value.response.status_code == 401  # as the Hub answers: missing and private look alike
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("acme/no-such-model", "config.json", endpoint=hub.endpoint, token=TOKEN,
                        cache_dir=tmp_path / "cache")
    with pytest.raises(RemoteEntryNotFoundError) as e:
        download(hub, tmp_path, "no-such-file.json")
    assert isinstance(e.value, EntryNotFoundError) and e.value.response.status_code == 404


def test_the_token_is_checked(hub, tmp_path):
    # A wrong token: 401 "Invalid credentials in Authorization header", which huggingface_hub
    # raises as the plain HfHubHTTPError (no subclass).
    with pytest.raises(HfHubHTTPError) as e:
        HfApi(endpoint=hub.endpoint, token="hf_wrong").model_info(REPO, revision="main")
    assert type(e.value) is HfHubHTTPError and e.value.response.status_code == 401
    with pytest.raises(HfHubHTTPError) as e:
        download(hub, tmp_path, "config.json", token="hf_wrong")
    assert type(e.value) is HfHubHTTPError and e.value.response.status_code == 401
    # No token at all: 401 RepoNotFound, as for a private repository on the Hub.
    with pytest.raises(RepositoryNotFoundError) as e:
        HfApi(endpoint=hub.endpoint, token=False).model_info(REPO, revision="main")
    assert e.value.response.status_code == 401
    with pytest.raises(RepositoryNotFoundError):
        download(hub, tmp_path, "config.json", token=False)


def test_bytes_served_counts_file_bytes(hub, tmp_path):
    before = hub.bytes_served()
    download(hub, tmp_path, "model.safetensors")
    assert hub.bytes_served() - before == MODEL_BYTES
    download(hub, tmp_path, "model.safetensors")  # in the client's cache: metadata only
    assert hub.bytes_served() - before == MODEL_BYTES
    assert any(m == "GET" and "/resolve/" in p and s == 200 for m, p, s in hub.requests())


def test_throttle_slows_a_download(hub, tmp_path):
    hub.set_throttle(1_000_000)
    try:
        t0 = time.monotonic()
        path = download(hub, tmp_path, "model.safetensors")
        elapsed = time.monotonic() - t0
    finally:
        hub.set_throttle(0)
    assert path.stat().st_size == MODEL_BYTES
    assert 1.5 <= elapsed < 30, elapsed
    t0 = time.monotonic()
    download(hub, tmp_path / "again", "model.safetensors")
    assert time.monotonic() - t0 < 1.5  # off again


def test_olah_unaided_and_a_clean_stop(revisions, tmp_path):
    """hub_compat=False: olah's own answers, so a change in olah shows here. Its offline
    mirror gives sizes and LFS sha256 in tree listings (not in model_info), answers an
    unknown revision as an unknown repository, and needs an explicit revision. Bound to all
    addresses, advertised on loopback; no token. stop() leaves no process behind."""
    psutil = pytest.importorskip("psutil")
    src = revisions[1]
    with HubServer({REPO: src}, host="0.0.0.0", advertise_host="127.0.0.1", hub_compat=False) as server:
        assert server.endpoint.startswith("http://127.0.0.1:")
        api = HfApi(endpoint=server.endpoint, token=False)
        info = api.model_info(REPO, revision="main", files_metadata=True)
        assert info.sha == server.commit(REPO) == server.commit(REPO, "v1")
        assert {s.rfilename: s.size for s in info.siblings}["model.safetensors"] is None
        tree = {f.path: f for f in api.list_repo_tree(REPO, revision="main", recursive=True)}
        assert tree["model.safetensors"].size == MODEL_BYTES
        assert tree["model.safetensors"].lfs.sha256 == hashlib.sha256((src / "model.safetensors").read_bytes()).hexdigest()
        assert tree["config.json"].size == (src / "config.json").stat().st_size and tree["config.json"].lfs is None
        paths = {p.path: p for p in api.get_paths_info(REPO, ["model.safetensors"], revision=info.sha)}
        assert paths["model.safetensors"].lfs.size == MODEL_BYTES
        with pytest.raises(RepositoryNotFoundError):
            api.model_info(REPO)
        with pytest.raises(RepositoryNotFoundError):
            api.model_info(REPO, revision="no-such-branch")
        path = Path(hf_hub_download(REPO, "model.safetensors", endpoint=server.endpoint, token=False,
                                    cache_dir=tmp_path / "cache"))
        assert path.read_bytes() == (src / "model.safetensors").read_bytes()
        assert server.bytes_served() == MODEL_BYTES
        olah = psutil.Process(server.olah_pid)
        procs = [olah, *olah.children(recursive=True)]
        workdir = server.workdir
    assert not any(p.is_running() for p in procs)
    assert not workdir.exists()
