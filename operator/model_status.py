"""status.model and the ModelReady condition of an hf:// or s3:// model.

Two sources of truth, kept apart:
- the revision: an hf:// revision (a branch, a tag, or none: main) is resolved to its commit
  by the operator once per source, before any pod exists, and pinned in status.model, so
  a branch that moves later cannot change a running deployment (or one new replica) silently;
  a wrong token, a missing repository or revision is Degraded at once, without a pod;
- the download: each pod's `model-fetch` init container reports its progress on its log
  (JSON lines; the operator reads the last one) and its outcome as its termination message.
The functions over pods are pure; the Hub call and the log reads take their I/O as
arguments."""
from __future__ import annotations

import base64
import json
import logging
from datetime import datetime, timezone
from typing import Callable, Optional

from kvpilot.engine.fetch.base import human_size

from .api.conditions import Problem, now_iso
from .manifests.model_download import INIT_CONTAINER, remote_source
from .api.spec import LLMDeploymentSpec
from .api.status import Condition, ModelDownloadStatus
from .model_size import ModelSize

log = logging.getLogger(__name__)

MODEL_READY = "ModelReady"
RETRY_FAILED_S = 30.0  # a failed resolution is asked again at most this often
RETRY_SIZING_S = 300.0  # an s3:// prefix that could not be listed (the pods run meanwhile)
LogReader = Callable[[str, str], Optional[str]]  # (pod, container) -> the log's last line


def _reason(fetch_reason: str) -> str:
    return f"Model{fetch_reason}"


def hub_token(kube, namespace: str, spec: LLMDeploymentSpec) -> str | None:
    """The token in spec.model.hf.tokenSecretRef (a missing Secret or key is a Problem found
    by find_problems; here it reads as no token)."""
    ref = spec.model.hf.token_secret_ref if spec.model.hf is not None else None
    if ref is None:
        return None
    secret = kube.get("v1", "Secret", namespace, ref.name) or {}
    if ref.key in (secret.get("stringData") or {}):
        return secret["stringData"][ref.key]
    raw = (secret.get("data") or {}).get(ref.key)
    return base64.b64decode(raw).decode().strip() if raw else None


def resolve_revision(spec: LLMDeploymentSpec, prev: ModelDownloadStatus | None, token: Callable[[], str | None],
                     now: datetime | None = None,
                     s3_size: Callable[[], ModelSize] | None = None) -> ModelDownloadStatus | None:
    """status.model for the spec's source: kept while the source is the one pinned; for a new
    hf:// source, the commit its revision names now (or the failure, retried every
    RETRY_FAILED_S); for an s3:// source, its size as `s3_size` lists it (unknown: retried
    every RETRY_SIZING_S). None for sources that are not downloaded."""
    src = remote_source(spec)
    if src is None:
        return None
    now = now or datetime.now(timezone.utc)
    endpoint = spec.model.hf.endpoint if spec.model.hf is not None else None
    same = prev is not None and prev.source == src
    if src.startswith("s3://"):
        cache = spec.model.cache  # a PVC, or a size given: nothing to size
        wanted = cache is None or not (cache.claim_name or cache.size_limit)
        return _sized(src, prev if same else None, s3_size if wanted else None, now)
    if same and prev.revision:
        return prev
    if same and prev.phase == "Failed" and prev.checked_at and \
            (now - _parse(prev.checked_at)).total_seconds() < RETRY_FAILED_S:
        return prev
    from kvpilot.engine.fetch.hub import hub_listing
    from kvpilot.engine.fetch.base import ModelFetchError
    from kvpilot.engine.fetch.uri import FileSelection, parse_source
    checked = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    try:
        listing = hub_listing(parse_source(src), FileSelection(tuple(spec.model.files)), endpoint, token())
    except ModelFetchError as e:
        return _failed(src, e.reason, str(e), checked)
    except Exception as e:  # never let a Hub surprise stop the reconcile
        log.warning("resolving %s failed: %s: %s", src, type(e).__name__, e)
        return _failed(src, "SourceError", f"{src}: {type(e).__name__}: {e}", checked)
    if not any(f.name == "config.json" for f in listing.files):
        return _failed(src, "FilesMissing", f"{src}: no config.json at commit {listing.key}", checked)
    return ModelDownloadStatus(source=src, revision=listing.key, phase="Pending", progress="Pending",
                       bytes_total=listing.total_bytes, files=len(listing.files), checked_at=checked)


def _sized(src: str, prev: ModelDownloadStatus | None, s3_size: Callable[[], ModelSize] | None,
           now: datetime) -> ModelDownloadStatus:
    """An s3:// source's status with its size listed once (a failed listing is asked again
    after RETRY_SIZING_S; the pods roll once when it succeeds, to the right cache size)."""
    base = prev or ModelDownloadStatus(source=src, phase="Pending", progress="Pending")
    if s3_size is None or (prev is not None and prev.checked_at and (
            prev.sizing is None or (now - _parse(prev.checked_at)).total_seconds() < RETRY_SIZING_S)):
        return base
    found = s3_size()
    update = {"sizing": found.note, "checked_at": now.strftime("%Y-%m-%dT%H:%M:%SZ")}
    if found.bytes is not None:
        update.update(bytes_total=found.bytes, files=found.files)
    return base.model_copy(update=update)


def sized_bytes(status: ModelDownloadStatus | None) -> int | None:
    """The bytes that size the download cache: the listing's, made up front (hf://, or s3://
    once listed); never what pods reported after downloading (that would roll them)."""
    if status is None or status.source is None:
        return None
    if status.source.startswith("s3://") and (status.checked_at is None or status.sizing is not None):
        return None
    return status.bytes_total


def _failed(src: str, reason: str, message: str, checked: str) -> ModelDownloadStatus:
    return ModelDownloadStatus(source=src, phase="Failed", progress="Failed", reason=_reason(reason),
                       message=message, checked_at=checked)


def unresolved(status: ModelDownloadStatus | None) -> bool:
    """An hf:// source without a pinned commit: no pods can run it yet."""
    return status is not None and status.source.startswith("hf://") and not status.revision


def _parse(ts: str) -> datetime:
    return datetime.strptime(ts, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)


def _init_status(pod: dict) -> dict | None:
    return next((c for c in (pod.get("status") or {}).get("initContainerStatuses") or []
                 if c.get("name") == INIT_CONTAINER), None)


def _terminated(cs: dict, key: str) -> dict:
    return (cs.get(key) or {}).get("terminated") or {}


def _json(text: str | None) -> dict:
    try:
        out = json.loads(text or "")
        return out if isinstance(out, dict) else {}
    except ValueError:
        return {}


def observe_pods(pods: list[dict], read_last_line: LogReader) -> tuple[str, dict, str | None]:
    """(phase, figures, pod) over the pods' init containers: Failed (with reason and message)
    before Downloading (the least advanced pod) before Ready before Pending."""
    failed, downloading, ready = [], [], []
    for pod in sorted(pods, key=lambda p: (p.get("metadata") or {}).get("name") or ""):
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        name = pod["metadata"]["name"]
        cs = _init_status(pod)
        if cs is None:
            continue
        state = cs.get("state") or {}
        now_term, last_term = _terminated(cs, "state"), _terminated(cs, "lastState")
        if now_term.get("exitCode") == 0:
            ready.append((name, _json(now_term.get("message"))))
        elif "running" in state:
            line = _json(read_last_line(name, INIT_CONTAINER))
            downloading.append((name, line))
        elif now_term or last_term:
            term = now_term or last_term
            outcome = _json(term.get("message"))
            failed.append((name, {"reason": outcome.get("reason") or "FetchFailed",
                                  "message": outcome.get("message") or
                                  f"exit code {term.get('exitCode')} ({term.get('reason') or 'Error'})",
                                  "restarts": cs.get("restartCount", 0)}))
    if failed:
        return "Failed", failed[0][1], failed[0][0]
    if downloading:
        name, figures = min(downloading, key=lambda d: d[1].get("percent", 0.0))
        return "Downloading", figures, name
    if ready:
        return "Ready", ready[0][1], ready[0][0]
    return "Pending", {}, None


def model_progress(status: ModelDownloadStatus, pods: list[dict], read_last_line: LogReader
                   ) -> tuple[ModelDownloadStatus, Condition, list[Problem]]:
    """status.model, the ModelReady condition and any Problem, from the pods (the revision
    already resolved)."""
    if unresolved(status):
        reason = status.reason or "ModelResolving"
        message = status.message or f"{status.source}: resolving the revision"
        return status, _condition(False, reason, message), [Problem(reason, message)]
    phase, fig, pod = observe_pods(pods, read_last_line)
    at = f"{status.source}" + (f"@{status.revision[:12]}" if status.revision else "")
    if phase == "Failed":
        reason = _reason(fig["reason"])
        message = f"pod {pod}: {fig['message']} ({fig['restarts']} restart(s))"
        new = status.model_copy(update={"phase": "Failed", "progress": "Failed", "message": message,
                                        "reason": reason, "bytes_per_second": None})
        return new, _condition(False, reason, message), [Problem(reason, message)]
    if phase == "Downloading":
        done, total = int(fig.get("done") or 0), int(fig.get("total") or status.bytes_total or 0)
        rate = int(fig.get("bytesPerSecond") or 0)
        pct = 100.0 * done / total if total else 0.0
        waiting = fig.get("phase") == "Waiting"
        verb = "Waiting" if waiting else ("Verifying" if fig.get("phase") == "Verifying" else "Downloading")
        message = (f"{at}: {verb} {pct:.0f}% ({human_size(done)} of {human_size(total)}) at {human_size(rate)}/s in pod {pod}"
                   + (" (another pod is downloading it into the shared cache)" if waiting else ""))
        new = status.model_copy(update={"phase": "Downloading", "progress": f"{verb} {pct:.0f}%",
                                        "bytes_done": done, "bytes_total": total or None,
                                        "bytes_per_second": rate, "message": message, "reason": None})
        return new, _condition(False, verb, message), []
    if phase == "Ready":
        total = int(fig.get("total") or status.bytes_total or 0)
        message = (f"{at}: {fig.get('files', status.files or 0)} file(s), {human_size(total)} in the cache"
                   f" (pod {pod} downloaded {human_size(int(fig.get('downloaded') or 0))})")
        revision = status.revision or (fig.get("revision") if status.source.startswith("s3://") else None)
        new = status.model_copy(update={"phase": "Ready", "progress": "Ready", "bytes_done": total,
                                        "bytes_total": total or None, "bytes_per_second": None,
                                        "files": fig.get("files", status.files), "message": message, "reason": None,
                                        "revision": revision})
        return new, _condition(True, "Ready", message), []
    if status.phase == "Ready" and not any(_init_status(p) for p in pods):
        # No pod now (scaled to zero, or between rollouts): the model stays resolved and fetched.
        return status, _condition(True, "Ready", status.message or f"{at}: downloaded"), []
    message = f"{at}: waiting for a pod to start downloading" + (f" ({status.sizing})" if status.sizing else "")
    new = status.model_copy(update={"phase": "Pending", "progress": "Pending", "message": message,
                                    "reason": None})
    return new, _condition(False, "Pending", message), []


def _condition(ok: bool, reason: str, message: str) -> Condition:
    return Condition(type=MODEL_READY, status="True" if ok else "False", reason=reason, message=message,
                     last_transition_time=now_iso())
