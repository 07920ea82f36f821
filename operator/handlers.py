"""kopf handlers: thin wrappers that call `reconcile` and translate its outcome
(TemporaryError while not ready, PermanentError for an invalid spec, Events for
problems). Imported only by `kvpilot operator` (it registers on import)."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
import time
from typing import Callable

import kopf

from .runtime import metrics
from .runtime.applied import AppliedCache
from .runtime.apply import Conflict, Kube
from .kube_config import load_kube_config
from .manifests.objects import INSTANCE_LABEL, MANAGED_BY
from .deployment_metrics import DeploymentMetrics
from .autotune.hook import autotune_step, autotune_step_for_pass
from .reconcile import parse_spec, reconcile, write_invalid
from .runtime.resync import DEFAULT_MAX_CONCURRENT, ResyncPool
from .names import GROUP, KIND, PLURAL, VERSION
from .api.fields import InvalidSpec
from .api.status import LLMDeploymentStatus

log = logging.getLogger(__name__)
RESYNC_SECONDS = float(os.environ.get("KVPILOT_RESYNC_SECONDS", "30"))  # the CLI sets it
WATCH_NAMESPACES = [n for n in os.environ.get("KVPILOT_WATCH_NAMESPACES", "").split(",") if n]
MAX_CONCURRENT_RECONCILES = int(os.environ.get("KVPILOT_MAX_CONCURRENT_RECONCILES",
                                               str(DEFAULT_MAX_CONCURRENT)))  # the CLI sets it
NOT_READY_DELAY = 10
KOPF_WORKERS = 8  # kopf's thread pool for the sync handlers (settings.execution.max_workers)

_state: dict = {}
_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock(ns: str, name: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault((ns, name), threading.Lock())


def _kube() -> Kube:
    if "kube" not in _state:
        _state["kube"] = Kube(_api_client(), AppliedCache())
        _state["hook"] = autotune_step
        _state["deployment_metrics"] = DeploymentMetrics()
    return _state["kube"]


def _api_client():
    """An ApiClient whose connection pool holds one connection per thread that may call at
    once (the resync workers and kopf's), rather than the client's default of 5 per CPU:
    a full pool drops connections, and each new one costs a TLS handshake."""
    from kubernetes import client
    cfg = client.Configuration.get_default_copy()
    cfg.connection_pool_maxsize = max(cfg.connection_pool_maxsize or 0, MAX_CONCURRENT_RECONCILES + KOPF_WORKERS)
    return client.ApiClient(cfg)


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
    settings.execution.max_workers = KOPF_WORKERS


def _leading(memo) -> Callable[[], bool] | None:
    """The leader-election gate `kvpilot operator --leader-elect` puts in kopf's memo (a
    leader.PassGate, or any callable saying whether this process leads); None without
    leader election."""
    return memo.get("leading") if memo is not None else None


def _acting(leading: Callable[[], bool] | None):
    """A context yielding whether a pass may act; a PassGate also counts it while it runs."""
    if leading is None:
        return contextlib.nullcontext(True)
    if hasattr(leading, "acting"):
        return leading.acting()
    return contextlib.nullcontext(leading())


def _pass(body, trigger: str, *, retry: bool, hook=None, wait_for_lock: bool = True,
          leading: Callable[[], bool] | None = None) -> None:
    """One reconcile, with leader election's gate: a process that cannot be sure it still
    holds the Lease (the API server did not answer its renewals, or it was frozen past the
    renew deadline) writes nothing, since a new leader may be at work."""
    with _acting(leading) as may_act:
        if not may_act:
            metrics.RECONCILES.labels(trigger, "not-leader").inc()
            ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
            log.warning("not reconciling %s/%s: leadership is no longer certain", ns, name)
            return
        _leader_pass(body, trigger, retry=retry, hook=hook, wait_for_lock=wait_for_lock)


def _leader_pass(body, trigger: str, *, retry: bool, hook=None, wait_for_lock: bool = True) -> None:
    """One reconcile under the object's lock, with metrics and error mapping. `hook`
    replaces the autotune hook (the resync's, sharing one Prometheus read per pass);
    without `wait_for_lock`, a pass that finds the lock held skips (the resync: the
    holder is an event-triggered pass doing the same work)."""
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    kube = _kube()
    lock = _lock(ns, name)
    if not lock.acquire(blocking=wait_for_lock):
        metrics.RESYNC_SKIPPED.labels("locked").inc()
        return
    start = time.monotonic()
    current = body
    try:
        try:
            # The freshest object, read under the lock: the body an event or the resync list
            # carried may predate the status the previous pass wrote (the autotuner's history
            # lives there), and reconciling from it would write that older status back.
            current = kube.get(f"{GROUP}/{VERSION}", KIND, ns, name) or body
            result = reconcile(kube, current, hook or _state.get("hook"))
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
    finally:
        lock.release()
    _state["deployment_metrics"].record(ns, name, parse_spec(current), result.status)
    for p in problems_to_announce(current, result):
        _warn(kube, current, p.reason, p.message)
    metrics.RECONCILES.labels(trigger, "ready" if result.ready else "progressing").inc()
    if retry and not result.ready and not result.problems:
        raise kopf.TemporaryError("waiting for pods to become ready", delay=NOT_READY_DELAY)


def _warn(kube: Kube, body: dict, reason: str, message: str) -> None:
    """A Warning Event on the LLMDeployment through the API client, as the autotuner posts
    its own: kopf.warn needs kopf's task context, which a resync worker thread lacks."""
    meta = body["metadata"]
    try:
        kube.create_event({"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": meta["name"],
                           "namespace": meta["namespace"], "uid": meta.get("uid")}, "Warning", reason, message)
    except Exception as e:  # an Event is a courtesy; it must not fail the pass
        log.warning("posting Event %s on %s/%s failed: %s", reason, meta["namespace"], meta["name"], e)


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


def _resync_one(body, hook, leading: Callable[[], bool] | None = None) -> None:
    _pass(body, "timer", retry=False, hook=hook, wait_for_lock=False, leading=leading)


async def _resync_loop(pool: ResyncPool) -> None:
    """Level-based re-reconcile of every LLMDeployment each RESYNC_SECONDS:
    corrects drift and runs the autotuner. A plain loop rather than
    @kopf.timer, which would put a finalizer on every object (and block its
    deletion whenever the operator is not running). Passes start on a fixed
    cadence and run in `pool` (bounded, concurrent, off the event loop); a pass
    does not wait for the previous one's stragglers, which the pool skips."""
    running: set[asyncio.Task] = set()
    next_start = time.monotonic() + RESYNC_SECONDS
    while True:
        await asyncio.sleep(max(0.0, next_start - time.monotonic()))
        next_start = max(next_start + RESYNC_SECONDS, time.monotonic())
        try:
            namespaces = WATCH_NAMESPACES or [None]
            bodies = [b for ns in namespaces for b in await asyncio.to_thread(_kube().list_llmdeployments, ns)]
            _state["deployment_metrics"].keep_only(  # a deleted deployment's series go with it
                {(b["metadata"]["namespace"], b["metadata"]["name"]) for b in bodies})
        except Exception:
            log.exception("resync: listing LLMDeployments failed")
            continue
        # One autotune hook per pass: every due deployment's MetricsSnapshot is cut from one
        # grouped set of Prometheus queries per URL instead of one set each.
        hook = autotune_step_for_pass()
        task = asyncio.get_running_loop().create_task(pool.run_pass(bodies, hook))
        running.add(task)
        task.add_done_callback(running.discard)


@kopf.on.startup()
async def start_resync(memo: kopf.Memo, **_) -> None:
    await asyncio.to_thread(_kube)  # made once, before the workers share it
    resync_one = functools.partial(_resync_one, leading=_leading(memo))
    memo["resync_pool"] = pool = ResyncPool(resync_one, MAX_CONCURRENT_RECONCILES)
    memo["resync"] = asyncio.get_running_loop().create_task(_resync_loop(pool))


@kopf.on.cleanup()
async def stop_resync(memo: kopf.Memo, **_) -> None:
    task = memo.get("resync")
    if task is not None:
        task.cancel()
    pool = memo.get("resync_pool")
    if pool is not None:
        pool.shutdown()


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

