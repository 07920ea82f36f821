"""An s3:// model's size found up front (issue 39): a bounded ListObjectsV2 over the prefix
sums the files the pods will download, which sizes the download's emptyDir and its
ephemeral-storage request; when the listing fails the cache keeps its 20 GiB default and
status.model.sizing says why. The S3 client is a fake (the real client is tested against
an S3 server in tests/engine/fetch/test_model_fetch_s3.py)."""
from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from kvpilot.operator.manifests.deployment import build_deployment
from kvpilot.operator.manifests.model_download import DEFAULT_S3_CACHE
from kvpilot.operator.manifests.objects import Owner
from kvpilot.operator.model_size import s3_client, s3_credentials, s3_model_size
from kvpilot.operator.model_status import RETRY_SIZING_S, model_progress, resolve_revision, sized_bytes
from kvpilot.operator.reconcile import parse_spec, reconcile
from test_operator_reconcile import FakeKube, body

OWNER = Owner("tiny", "demo", "u")
GiB = 2**30
OBJECTS = [("models/llama/config.json", 700), ("models/llama/model-00001.safetensors", 5 * GiB),
           ("models/llama/model-00002.safetensors", 3 * GiB), ("models/llama/tokenizer.json", 9000),
           ("models/llama/README.md", 10 * GiB), ("models/llama/original/consolidated.pth", 16 * GiB),
           ("models/llama-other/config.json", 50)]
SELECTED = 700 + 8 * GiB + 9000


def spec(model: dict):
    return parse_spec({"spec": {"model": model}})


S3 = {"source": "s3://bucket/models/llama", "s3": {"endpoint": "http://minio:9000", "pathStyle": True,
                                                   "credentialsSecretRef": {"name": "s3"}}}


class FakeS3:
    """list_objects_v2 over OBJECTS, `page` keys a page; or failing as told."""

    def __init__(self, objects=OBJECTS, page=2, fail=None, endless=False):
        self.objects, self.page, self.fail, self.endless = objects, page, fail, endless
        self.calls = []

    def __call__(self, spec, credentials, timeout):  # the client factory
        self.made = (credentials, timeout)
        return self

    def list_objects_v2(self, Bucket, Prefix, ContinuationToken=None):
        self.calls.append((Bucket, Prefix, ContinuationToken))
        if self.fail is not None:
            raise self.fail
        if self.endless:
            return {"Contents": [{"Key": f"{Prefix}x{len(self.calls)}.bin", "Size": 1}], "IsTruncated": True,
                    "NextContinuationToken": str(len(self.calls))}
        keys = [(k, n) for k, n in self.objects if k.startswith(Prefix)]
        start = int(ContinuationToken or 0)
        chunk = keys[start:start + self.page]
        more = start + self.page < len(keys)
        return {"Contents": [{"Key": k, "Size": n, "ETag": '"e"'} for k, n in chunk], "IsTruncated": more,
                **({"NextContinuationToken": str(start + self.page)} if more else {})}


def test_the_listing_sums_the_files_the_pods_download_across_pages_with_the_secrets_keys():
    kube = FakeKube({("Secret", "s3"): {"data": {"AWS_ACCESS_KEY_ID": "aWQ=", "AWS_SECRET_ACCESS_KEY": "c2VjcmV0"},
                                        "stringData": {"AWS_SESSION_TOKEN": "tok", "OTHER": "x"}}})
    s = spec(S3)
    fake = FakeS3()
    size = s3_model_size(s, lambda: s3_credentials(kube, "demo", s), client=fake)
    assert (size.bytes, size.files, size.note) == (SELECTED, 4, None)
    assert fake.made[0] == {"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "secret", "AWS_SESSION_TOKEN": "tok"}
    assert [c[2] for c in fake.calls] == [None, "2", "4"]  # three pages, the prefix's own objects only
    assert all(c[:2] == ("bucket", "models/llama/") for c in fake.calls)
    extra = spec({**S3, "files": ["original/*"]})
    assert s3_model_size(extra, lambda: {}, client=FakeS3()).bytes == SELECTED + 16 * GiB


def test_resolve_sizes_an_s3_model_once_and_the_pods_cache_follows():
    s = spec(S3)
    fake = FakeS3()
    status = resolve_revision(s, None, lambda: None, s3_size=lambda: s3_model_size(s, lambda: {}, client=fake))
    assert (status.bytes_total, status.files, status.sizing, status.phase) == (SELECTED, 4, None, "Pending")
    assert status.checked_at is not None and sized_bytes(status) == SELECTED
    calls = len(fake.calls)
    again = resolve_revision(s, status, lambda: None, s3_size=lambda: s3_model_size(s, lambda: {}, client=fake))
    assert again == status and len(fake.calls) == calls  # listed once per source
    pod = build_deployment(OWNER, s, 1, None, sized_bytes(status))["spec"]["template"]["spec"]
    cache = -(-int(SELECTED * 1.1) // GiB) * GiB + GiB  # files + 10% in whole GiB, + 1 GiB: 10 GiB
    assert cache == 10 * GiB
    assert next(v for v in pod["volumes"] if v["name"] == "model-cache")["emptyDir"] == {"sizeLimit": str(cache)}
    assert pod["initContainers"][0]["resources"]["requests"]["ephemeral-storage"] == str(cache)


@pytest.mark.parametrize("fail, words", [
    (ClientError({"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}, "ListObjectsV2"),
     "refused the credentials"),
    (ClientError({"Error": {"Code": "NoSuchBucket"}}, "ListObjectsV2"), "bucket 'bucket' does not exist"),
    (EndpointConnectionError(endpoint_url="http://minio:9000"), "cannot reach http://minio:9000"),
    (RuntimeError("surprise"), "RuntimeError: surprise"),
])
def test_a_listing_that_fails_keeps_the_default_cache_says_why_and_is_retried_slowly(fail, words):
    s = spec(S3)
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    status = resolve_revision(s, None, lambda: None, now,
                              s3_size=lambda: s3_model_size(s, lambda: {}, client=FakeS3(fail=fail)))
    assert status.bytes_total is None and words in status.sizing and "the download cache is 20Gi" in status.sizing
    assert sized_bytes(status) is None
    pod = build_deployment(OWNER, s, 1, None, sized_bytes(status))["spec"]["template"]["spec"]
    assert next(v for v in pod["volumes"] if v["name"] == "model-cache")["emptyDir"] == {
        "sizeLimit": str(DEFAULT_S3_CACHE)}
    # The status message says it while the pods start.
    _, condition, _ = model_progress(status, [], lambda pod, container: None)
    assert words in condition.message
    # The pods' own report of the total (after downloading) does not resize the cache.
    reported = status.model_copy(update={"bytes_total": SELECTED})
    assert sized_bytes(reported) is None
    fixed = FakeS3()
    soon = resolve_revision(s, status, lambda: None, now + timedelta(seconds=RETRY_SIZING_S - 1),
                            s3_size=lambda: s3_model_size(s, lambda: {}, client=fixed))
    assert soon == status and not fixed.calls
    later = resolve_revision(s, status, lambda: None, now + timedelta(seconds=RETRY_SIZING_S + 1),
                             s3_size=lambda: s3_model_size(s, lambda: {}, client=fixed))
    assert later.sizing is None and sized_bytes(later) == SELECTED


def test_the_listing_is_bounded_in_time():
    s = spec(S3)
    started = time.monotonic()
    size = s3_model_size(s, lambda: {}, client=FakeS3(endless=True), timeout=0.2)
    assert time.monotonic() - started < 2.0
    assert size.bytes is None and "took too long" in size.note


def test_no_listing_where_nothing_is_sized_by_it():
    for cache in ({"claimName": "models"}, {"sizeLimit": "40Gi"}):
        s = spec({**S3, "cache": cache})
        fake = FakeS3()
        status = resolve_revision(s, None, lambda: None, s3_size=lambda: s3_model_size(s, lambda: {}, client=fake))
        assert not fake.calls and status.checked_at is None and status.sizing is None


def test_the_client_is_unsigned_without_a_secret_and_never_retries():
    from botocore import UNSIGNED

    s = spec({"source": "s3://bucket/x"})
    client = s3_client(s, {}, 1.5)
    config = client.meta.config
    assert config.signature_version is UNSIGNED
    assert (config.connect_timeout, config.read_timeout, config.retries) == (1.5, 1.5, {"total_max_attempts": 1, "mode": "standard"})
    signed = s3_client(spec(S3), {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b"}, 1.0)
    assert signed.meta.config.signature_version is not UNSIGNED
    assert signed.meta.endpoint_url == "http://minio:9000"


def test_reconcile_sizes_the_cache_from_the_listing(monkeypatch):
    fake = FakeS3()
    monkeypatch.setattr("kvpilot.operator.model_size.s3_client", fake)
    kube = FakeKube({("Secret", "s3"): {"stringData": {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b"}}})
    result = reconcile(kube, body({"model": S3}))
    assert result.status.model.bytes_total == SELECTED and result.status.model.sizing is None
    deployment = next(m for m, _ in kube.applied if m["kind"] == "Deployment")
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert next(v for v in volumes if v["name"] == "model-cache")["emptyDir"] == {"sizeLimit": str(10 * GiB)}
    assert fake.made[0] == {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b"}
