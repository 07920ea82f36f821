"""The S3 server the s3:// model source tests run against (tests/s3_server.py, gofakes3 built
by e2e/s3server/build.sh) behaves as S3 does where the download code relies on it: prefix
listings, byte-exact bodies, MD5 ETags of single-part uploads, Range GETs (resume), the
NoSuchBucket error; and its hooks count served bytes and throttle downloads."""
from __future__ import annotations

import hashlib
import os
import time

import pytest
from botocore.exceptions import ClientError

from s3_server import S3Server

BIG = 2 * 1024 * 1024


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text('{"hidden_size": 64}')
    (d / "tokenizer.json").write_text('{"version": "1.0"}')
    (d / "weights").mkdir()
    (d / "weights" / "model.safetensors").write_bytes(os.urandom(BIG))
    return d


@pytest.fixture(scope="module")
def s3(model_dir):
    with S3Server() as server:
        server.upload_dir("models", "tiny/v1", model_dir)
        yield server


def body(s3, key: str, **kw) -> bytes:
    return s3.client().get_object(Bucket="models", Key=key, **kw)["Body"].read()


def test_listing_and_bodies_match_the_uploaded_files(s3, model_dir):
    c = s3.client()
    listed = c.list_objects_v2(Bucket="models", Prefix="tiny/v1/")
    got = {o["Key"]: o["Size"] for o in listed["Contents"]}
    assert got == {
        "tiny/v1/config.json": (model_dir / "config.json").stat().st_size,
        "tiny/v1/tokenizer.json": (model_dir / "tokenizer.json").stat().st_size,
        "tiny/v1/weights/model.safetensors": BIG,
    }
    assert listed["KeyCount"] == 3 and not listed["IsTruncated"]
    # An empty listing has no Contents; gofakes3 also leaves out KeyCount (S3 sends 0).
    assert "Contents" not in c.list_objects_v2(Bucket="models", Prefix="tiny/v2/")
    for key in got:
        assert body(s3, key) == (model_dir / key.removeprefix("tiny/v1/")).read_bytes(), key


def test_single_part_etag_is_the_md5_of_the_content(s3, model_dir):
    want = hashlib.md5((model_dir / "weights" / "model.safetensors").read_bytes()).hexdigest()
    head = s3.client().head_object(Bucket="models", Key="tiny/v1/weights/model.safetensors")
    assert head["ETag"] == f'"{want}"'
    assert head["ContentLength"] == BIG


def test_bytes_served_counts_downloaded_bodies(s3):
    before_bytes, before_gets = s3.bytes_served(), s3.get_requests()
    assert len(body(s3, "tiny/v1/weights/model.safetensors")) == BIG
    s3.client().head_object(Bucket="models", Key="tiny/v1/config.json")  # no body: not counted
    assert s3.bytes_served() - before_bytes == BIG
    assert s3.get_requests() - before_gets == 1


def test_range_get_returns_the_tail(s3, model_dir):
    data = (model_dir / "weights" / "model.safetensors").read_bytes()
    before = s3.bytes_served()
    r = s3.client().get_object(Bucket="models", Key="tiny/v1/weights/model.safetensors", Range="bytes=100-")
    assert r["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert r["ContentRange"] == f"bytes 100-{BIG - 1}/{BIG}"
    assert r["Body"].read() == data[100:]
    assert s3.bytes_served() - before == BIG - 100  # a resume costs only the rest
    # A range past the end is S3's InvalidRange (416), which a resumer must tell from success.
    with pytest.raises(ClientError) as err:
        s3.client().get_object(Bucket="models", Key="tiny/v1/config.json", Range="bytes=9999-")
    assert err.value.response["Error"]["Code"] == "InvalidRange"


def test_throttle_slows_downloads(s3):
    s3.set_throttle(1024 * 1024)
    try:
        start = time.monotonic()
        assert len(body(s3, "tiny/v1/weights/model.safetensors")) == BIG
        took = time.monotonic() - start
    finally:
        s3.set_throttle(0)
    assert took >= 1.5, f"2 MiB at 1 MiB/s took {took:.2f} s"
    start = time.monotonic()
    body(s3, "tiny/v1/weights/model.safetensors")
    assert time.monotonic() - start < 1.0, "lifting the throttle did not take effect"


def test_missing_bucket_is_no_such_bucket(s3):
    with pytest.raises(ClientError) as err:
        s3.client().list_objects_v2(Bucket="no-such-bucket", Prefix="x/")
    assert err.value.response["Error"]["Code"] == "NoSuchBucket"
    with pytest.raises(ClientError) as err:
        s3.client().get_object(Bucket="no-such-bucket", Key="x")
    assert err.value.response["Error"]["Code"] == "NoSuchBucket"


def test_in_memory_listings_page(model_dir):
    with S3Server(memory=True) as s3:
        s3.upload_dir("models", "tiny", model_dir)
        pages = s3.client().get_paginator("list_objects_v2").paginate(
            Bucket="models", Prefix="tiny/", PaginationConfig={"PageSize": 2})
        assert [len(p["Contents"]) for p in pages] == [2, 1]
        assert body(s3, "tiny/config.json") == (model_dir / "config.json").read_bytes()


def test_stop_ends_the_process(model_dir):
    server = S3Server().start()
    proc = server.proc
    server.stop()
    assert proc.poll() is not None
