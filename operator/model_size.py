"""An s3:// model's size, found up front as an hf:// model's is (model_status.py): the sum
of the files the pods will download (the same selection), from ListObjectsV2 over the
prefix with a bounded time, so the download's emptyDir gets a sizeLimit and an
ephemeral-storage request sized from the model instead of DEFAULT_S3_CACHE.

The listing uses the credentials in spec.model.s3.credentialsSecretRef, else no
credentials at all (an anonymous request, which a public bucket answers): never the
operator's own identity, which may reach buckets the deployment's owner cannot. When it
cannot list (no access, no answer in time, an error), the size stays unknown and a note
says why; the cache keeps its default."""
from __future__ import annotations

import base64
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

from .api.spec import LLMDeploymentSpec
from .manifests.model_download import DEFAULT_S3_CACHE

log = logging.getLogger(__name__)

S3_SIZE_TIMEOUT_S = 5.0  # the whole listing: each call's connect and read, and every page
CREDENTIAL_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
ClientFactory = Callable[[LLMDeploymentSpec, dict, float], object]


@dataclass(frozen=True)
class ModelSize:
    bytes: Optional[int]  # None: unknown (note says why)
    files: Optional[int]
    note: Optional[str] = None


def s3_credentials(kube, namespace: str, spec: LLMDeploymentSpec) -> dict:
    """The keys of spec.model.s3.credentialsSecretRef's Secret ({} without one, or when it is
    missing: find_problems reports that)."""
    ref = spec.model.s3.credentials_secret_ref if spec.model.s3 is not None else None
    if ref is None:
        return {}
    secret = kube.get("v1", "Secret", namespace, ref.name) or {}
    out = {k: v for k, v in (secret.get("stringData") or {}).items() if k in CREDENTIAL_KEYS}
    for key, raw in (secret.get("data") or {}).items():
        if key in CREDENTIAL_KEYS and key not in out:
            out[key] = base64.b64decode(raw).decode().strip()
    return out


def s3_client(spec: LLMDeploymentSpec, credentials: dict, timeout: float):
    """A boto3 S3 client for the spec's store: one attempt per call, `timeout` to connect and
    to read, the Secret's keys or unsigned requests."""
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    opts = spec.model.s3
    config = Config(s3={"addressing_style": "path" if opts is not None and opts.path_style else "auto"},
                    retries={"total_max_attempts": 1, "mode": "standard"}, connect_timeout=timeout,
                    read_timeout=timeout, **({} if credentials else {"signature_version": UNSIGNED}))
    return boto3.client("s3", endpoint_url=opts.endpoint if opts is not None else None,
                        region_name=(opts.region if opts is not None else None) or "us-east-1", config=config,
                        aws_access_key_id=credentials.get("AWS_ACCESS_KEY_ID"),
                        aws_secret_access_key=credentials.get("AWS_SECRET_ACCESS_KEY"),
                        aws_session_token=credentials.get("AWS_SESSION_TOKEN"))


def s3_model_size(spec: LLMDeploymentSpec, credentials: Callable[[], dict],
                  client: ClientFactory | None = None, timeout: float = S3_SIZE_TIMEOUT_S) -> ModelSize:
    """The selected files' bytes under the spec's s3:// prefix, or unknown with a note.
    `client(spec, credentials, timeout)` makes the S3 client (default s3_client)."""
    from kvpilot.engine.fetch.base import ModelFetchError
    from kvpilot.engine.fetch.s3 import S3Options, s3_listing
    from kvpilot.engine.fetch.uri import FileSelection, parse_source

    src = spec.model.source
    fallback = f"the download cache is {DEFAULT_S3_CACHE // 2**30}Gi (model.cache.sizeLimit sets it)"
    try:
        source = parse_source(src)
        opts = spec.model.s3
        options = S3Options(endpoint_url=opts.endpoint if opts else None, region=opts.region if opts else None,
                            path_style=bool(opts and opts.path_style))
        listing = s3_listing(source, FileSelection(tuple(spec.model.files)), options,
                             client=(client or s3_client)(spec, credentials(), timeout),
                             deadline=time.monotonic() + timeout)
    except ModelFetchError as e:
        return ModelSize(None, None, f"size unknown: {e}; {fallback}")
    except Exception as e:  # noqa: BLE001 (never let a store's surprise stop the reconcile)
        log.warning("sizing %s failed: %s: %s", src, type(e).__name__, e)
        return ModelSize(None, None, f"size unknown: {src}: {type(e).__name__}: {e}; {fallback}")
    return ModelSize(listing.total_bytes, len(listing.files))
