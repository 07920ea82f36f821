"""kopf handlers: thin wrappers that call `reconcile` and translate its outcome
(TemporaryError while not ready, PermanentError for an invalid spec, Events for
problems). Imported only by `kvpilot operator` (it registers on import)."""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Callable

import kopf

from . import metrics
from .apply import Conflict, Kube
from .objects import INSTANCE_LABEL, MANAGED_BY
from .reconcile import load_autotune_hook, reconcile, write_invalid
from .spec import GROUP, KIND, PLURAL, VERSION, InvalidSpec
from .status import LLMDeploymentStatus

log = logging.getLogger(__name__)
RESYNC_SECONDS = float(os.environ.get("KVPILOT_RESYNC_SECONDS", "30"))  # the CLI sets it
WATCH_NAMESPACES = [n for n in os.environ.get("KVPILOT_WATCH_NAMESPACES", "").split(",") if n]
NOT_READY_DELAY = 10

_state: dict = {}
_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock(ns: str, name: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault((ns, name), threading.Lock())


def _kube() -> Kube:
    if "kube" not in _state:
        _state["kube"] = Kube()
        _state["hook"] = load_autotune_hook()
    return _state["kube"]


def load_kube_config() -> None:
    """$KUBECONFIG when set (how the e2e node runs it), else in-cluster, else ~/.kube/config."""
    from kubernetes import config
    if os.environ.get("KUBECONFIG"):
        config.load_kube_config()
        return
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


@kopf.on.login()
def login(**_) -> kopf.ConnectionInfo:
    """kopf's own API connection, from the same configuration as the kubernetes client's."""
    from kubernetes import client
    load_kube_config()
    cfg = client.Configuration.get_default_copy()
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    scheme, _, token = (header or "").partition(" ")
    return kopf.ConnectionInfo(
        server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
        scheme=scheme or None, token=token or None,
        certificate_path=cfg.cert_file, private_key_path=cfg.key_file)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_) -> None:
    load_kube_config()
    prefix = GROUP
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=prefix)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=prefix, key="last-handled-configuration")
    settings.persistence.finalizer = f"{prefix}/finalizer"
    settings.peering.standalone = True  # HA is a Lease (--leader-elect): a standby never starts kopf
    settings.scanning.disabled = True  # no CRD list/watch permission needed; the CRD exists first
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.batching.error_delays = [1, 2, 5, 10, 30, 60]
    settings.execution.max_workers = 8


def _leading(memo) -> Callable[[], bool] | None:
    """The leader-election check `kvpilot operator --leader-elect` puts in kopf's memo; None
    without leader election."""
    return memo.get("leading") if memo is not None else None


def _pass(body, trigger: str, *, retry: bool, leading: Callable[[], bool] | None = None) -> None:
    """One reconcile under the object's lock, with metrics and error mapping. With leader
    election, a process that cannot be sure it still holds the Lease (it was frozen past
    the renew deadline) writes nothing: it is about to exit, and a new leader may be at work."""
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    kube = _kube()
    start = time.monotonic()
    current = body
    with _lock(ns, name):
        if leading is not None and not leading():
            metrics.RECONCILES.labels(trigger, "not-leader").inc()
            log.warning("not reconciling %s/%s: leadership is no longer certain", ns, name)
            return
        try:
            # The freshest object, read under the lock: the body an event or the resync list
            # carried may predate the status the previous pass wrote (the autotuner's history
            # lives there), and reconciling from it would write that older status back.
            current = kube.get(f"{GROUP}/{VERSION}", KIND, ns, name) or body
            result = reconcile(kube, current, _state.get("hook"))
        except InvalidSpec as e:
            metrics.RECONCILES.labels(trigger, "invalid").inc()
            metrics.ERRORS.labels("InvalidSpec").inc()
            kopf.warn(body, reason="InvalidSpec", message=str(e))
            write_invalid(kube, current, str(e))
            if retry:
                raise kopf.PermanentError(f"invalid spec: {e}") from None
            return
        except Conflict as e:
            metrics.RECONCILES.labels(trigger, "conflict").inc()
            metrics.ERRORS.labels("Conflict").inc()
            if retry:
                raise kopf.TemporaryError(str(e), delay=5) from None
            log.info("%s", e)
            return
        except Exception as e:
            metrics.RECONCILES.labels(trigger, "error").inc()
            metrics.ERRORS.labels(type(e).__name__).inc()
            if retry:
                raise kopf.TemporaryError(f"{type(e).__name__}: {e}", delay=NOT_READY_DELAY) from e
            log.exception("reconcile %s/%s failed", ns, name)
            return
        finally:
            metrics.DURATION.observe(time.monotonic() - start)
    for p in problems_to_announce(current, result):
        kopf.warn(body, reason=p.reason, message=p.message)
    metrics.RECONCILES.labels(trigger, "ready" if result.ready else "progressing").inc()
    if retry and not result.ready and not result.problems:
        raise kopf.TemporaryError("waiting for pods to become ready", delay=NOT_READY_DELAY)


def problems_to_announce(previous: dict, result) -> list:
    """The problems to post as Warning Events: all of them when Degraded's message changed
    since the status the pass started from (a new problem, or a crash loop's next restart),
    none while it stays the same (a resync every second must not post an Event a second)."""
    if not result.problems:
        return []
    before = LLMDeploymentStatus.model_validate(dict(previous.get("status") or {})).condition("Degraded")
    after = result.status.condition("Degraded")
    if before is not None and after is not None and (before.status, before.message) == (after.status, after.message):
        return []
    return list(result.problems)


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def on_change(body, memo=None, **_) -> None:
    _pass(body, "change", retry=True, leading=_leading(memo))


async def _resync_loop(leading: Callable[[], bool] | None = None) -> None:
    """Level-based re-reconcile of every LLMDeployment each RESYNC_SECONDS:
    corrects drift and runs the autotuner. A plain loop rather than
    @kopf.timer, which would put a finalizer on every object (and block its
    deletion whenever the operator is not running)."""
    while True:
        await asyncio.sleep(RESYNC_SECONDS)
        try:
            namespaces = WATCH_NAMESPACES or [None]
            bodies = [b for ns in namespaces for b in await asyncio.to_thread(_kube().list_llmdeployments, ns)]
        except Exception:
            log.exception("resync: listing LLMDeployments failed")
            continue
        for body in bodies:
            if not body["metadata"].get("deletionTimestamp"):
                await asyncio.to_thread(_pass, body, "timer", retry=False, leading=leading)


@kopf.on.startup()
async def start_resync(memo: kopf.Memo, **_) -> None:
    memo["resync"] = asyncio.get_running_loop().create_task(_resync_loop(_leading(memo)))


@kopf.on.cleanup()
async def stop_resync(memo: kopf.Memo, **_) -> None:
    task = memo.get("resync")
    if task is not None:
        task.cancel()


@kopf.on.event("apps", "v1", "deployments", labels={"app.kubernetes.io/managed-by": MANAGED_BY})
def owned_deployment(event, body, memo=None, **_) -> None:
    """A Deployment we own changed or vanished: reconcile its LLMDeployment now
    (recreates a deleted one, reverts hand edits, refreshes status)."""
    name = (body.get("metadata", {}).get("labels") or {}).get(INSTANCE_LABEL)
    ns = body.get("metadata", {}).get("namespace")
    if not name or not ns:
        return
    owner = _kube().get(f"{GROUP}/{VERSION}", "LLMDeployment", ns, name)
    if owner is None or owner["metadata"].get("deletionTimestamp"):
        return
    _pass(owner, f"deployment-{(event.get('type') or 'event').lower()}", retry=False, leading=_leading(memo))

