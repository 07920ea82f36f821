"""The S3 side of `s3://` sources, through boto3 (AWS, MinIO, Ceph RGW, R2, SeaweedFS...).

Configuration is boto3's own environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_ENDPOINT_URL, AWS_REGION or AWS_DEFAULT_REGION) plus KVPILOT_S3_PATH_STYLE=1 for
stores that need path-style addressing (MinIO and most self-hosted ones).

An object is downloaded into NAME.incomplete with ranged GETs conditional on the listing's
ETag: a crash resumes from the bytes already on disk, and an object replaced mid-download
is refused (SourceChanged) instead of being stitched from two versions."""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .base import (BUCKET_NOT_FOUND, FILES_MISSING, SOURCE_CHANGED, UNAUTHORIZED, UNREACHABLE, Listing,
                          ModelFetchError, RemoteFile)
from .cache import is_whole, writing_whole
from .uri import FileSelection, S3Source

CHUNK = 1 << 20
_AUTH_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
               "ExpiredToken", "AllAccessDisabled", "403", "401"}


@dataclass(frozen=True)
class S3Options:
    endpoint_url: str | None = None
    region: str | None = None
    path_style: bool = False

    @classmethod
    def from_env(cls) -> "S3Options":
        return cls(endpoint_url=os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None,
                   region=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None,
                   path_style=os.environ.get("KVPILOT_S3_PATH_STYLE", "").lower() in ("1", "true", "yes"))

    def client(self):
        import boto3
        from botocore.config import Config
        config = Config(s3={"addressing_style": "path" if self.path_style else "auto"},
                        retries={"max_attempts": 4, "mode": "standard"}, connect_timeout=10, read_timeout=60)
        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name=self.region or "us-east-1",
                            config=config)


def s3_error(exc: Exception, source: S3Source, options: S3Options) -> ModelFetchError:
    from botocore.exceptions import ClientError, NoCredentialsError
    where = options.endpoint_url or "AWS S3"
    if isinstance(exc, NoCredentialsError):
        return ModelFetchError(UNAUTHORIZED, f"{source.uri}: no S3 credentials (AWS_ACCESS_KEY_ID and "
                                             "AWS_SECRET_ACCESS_KEY)")
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket":
            return ModelFetchError(BUCKET_NOT_FOUND, f"{source.uri}: bucket {source.bucket!r} does not exist at {where}")
        if code in _AUTH_CODES or status in (401, 403):
            return ModelFetchError(UNAUTHORIZED, f"{source.uri}: {where} refused the credentials ({code or status})")
        if code in ("NoSuchKey", "404"):
            return ModelFetchError(FILES_MISSING, f"{source.uri}: an object listed a moment ago is gone ({code})")
        if code in ("PreconditionFailed", "412"):
            return ModelFetchError(SOURCE_CHANGED, f"{source.uri}: an object changed during the download; "
                                                   "the next attempt starts from the new listing")
        return ModelFetchError(UNREACHABLE, f"{source.uri}: {where} answered {code or status}")
    return ModelFetchError(UNREACHABLE, f"{source.uri}: cannot reach {where}: {type(exc).__name__}: {exc}")


def _errors() -> tuple[type[BaseException], ...]:
    from botocore.exceptions import BotoCoreError, ClientError
    return (BotoCoreError, ClientError)


def s3_listing(source: S3Source, selection: FileSelection, options: S3Options, client=None,
               deadline: float | None = None) -> Listing:
    """The objects under the prefix to fetch; the listing's digest names the snapshot, so a
    changed object is a new snapshot and an unchanged prefix is found in the cache.
    `client`: an S3 client (default: options.client()); `deadline` (time.monotonic()):
    no page is asked for after it (UNREACHABLE), for a caller that may not wait long."""
    root = f"{source.prefix}/" if source.prefix else ""
    objects = {}
    page: dict = {}
    try:
        client = client or options.client()
        while True:
            if deadline is not None and time.monotonic() >= deadline:
                raise ModelFetchError(UNREACHABLE, f"{source.uri}: listing the prefix took too long "
                                                   f"({len(objects)} objects so far)")
            token = page.get("NextContinuationToken")
            page = client.list_objects_v2(Bucket=source.bucket, Prefix=root,
                                          **({"ContinuationToken": token} if token else {}))
            for obj in page.get("Contents") or []:
                name = obj["Key"][len(root):]
                if name and not name.endswith("/"):
                    objects[name] = obj
            if not page.get("IsTruncated") or not page.get("NextContinuationToken"):
                break
    except _errors() as e:
        raise s3_error(e, source, options) from None
    files = []
    for name in selection.select(list(objects)):
        obj = objects[name]
        etag = str(obj.get("ETag", "")).strip('"')
        # A single-part upload's ETag is the MD5 of the object (multipart ones have a '-N').
        md5 = etag if len(etag) == 32 and "-" not in etag else None
        files.append(RemoteFile(name, int(obj["Size"]), md5=md5, etag=etag or None))
    if not files:
        found = ", ".join(sorted(objects)[:5]) or "nothing"
        raise ModelFetchError(FILES_MISSING, f"{source.uri}: no model files under the prefix (found: {found})")
    digest = hashlib.sha256("\n".join(f"{f.name}\t{f.size}\t{f.etag}" for f in files).encode()).hexdigest()
    return Listing(key=digest[:20], files=tuple(files), refs=("latest",))


def s3_download(source: S3Source, file: RemoteFile, partial: Path, options: S3Options) -> None:
    dest = partial / file.name
    if is_whole(dest, file.size):
        return  # finished before a crash
    key = f"{source.prefix}/{file.name}" if source.prefix else file.name
    try:
        with writing_whole(dest, file.size) as (out, have):
            if file.size is None or have < file.size:
                extra = {"IfMatch": f'"{file.etag}"'} if file.etag else {}
                if have:
                    extra["Range"] = f"bytes={have}-"
                body = options.client().get_object(Bucket=source.bucket, Key=key, **extra)["Body"]
                for chunk in body.iter_chunks(CHUNK):
                    out.write(chunk)
    except _errors() as e:
        raise s3_error(e, source, options) from None
