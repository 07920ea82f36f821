"""Pure: the engine pods' container states -> Problems (Degraded with the reason).

The Deployment's own status only says how many pods are ready; why the others are not
(a crash loop, an image that cannot be pulled, a config the kubelet refuses) is in each
pod's containerStatuses. A container waiting for one of BLOCKING_REASONS is a problem that
will not clear by waiting; its message names the pod, the container, the restarts, and the
last exit code and termination message (FallbackToLogsOnError puts the log's tail there)."""
from __future__ import annotations

from .api.conditions import Problem
from .manifests.model_download import INIT_CONTAINER

# Waiting reasons that mean the container will not start without a change (ContainerCreating
# and PodInitializing are the normal way up and are left out).
BLOCKING_REASONS = ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
                    "CreateContainerConfigError", "CreateContainerError", "RunContainerError")
MESSAGE_CHARS = 400  # of a termination message: enough for the error line, not the whole log


def _last_exit(status: dict) -> str:
    term = ((status.get("lastState") or {}).get("terminated")
            or (status.get("state") or {}).get("terminated") or {})
    if not term:
        return ""
    text = f"; last exit code {term.get('exitCode')}"
    if term.get("reason"):
        text += f" ({term['reason']})"
    message = " ".join((term.get("message") or "").split())
    if message:
        text += f": {message[-MESSAGE_CHARS:]}"
    return text


def container_problems(pod: dict) -> list[Problem]:
    """The blocking waits of one pod's containers (init containers included)."""
    meta, st = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return []  # going away: not what runs
    out = []
    for cs in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason not in BLOCKING_REASONS:
            continue
        if reason == "CrashLoopBackOff" and cs.get("name") == INIT_CONTAINER:
            continue  # a failing model download: model_status names its cause (ModelUnauthorized, ...)
        detail = _last_exit(cs) or (f": {waiting['message']}" if waiting.get("message") else "")
        out.append(Problem(reason, f"pod {meta.get('name')} container {cs.get('name')}: {reason}, "
                                   f"{cs.get('restartCount', 0)} restart(s){detail}"))
    return out


def pod_problems(pods: list[dict]) -> list[Problem]:
    """Every pod's blocking container states, pods in name order (a stable message)."""
    return [p for pod in sorted(pods, key=lambda x: (x.get("metadata") or {}).get("name") or "")
            for p in container_problems(pod)]
