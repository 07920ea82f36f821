"""Pure: the pod-template pieces for a model fetched from hf:// or s3://.

An init container (the engine's own image) runs `kvpilot fetch-model` into a cache volume
(an emptyDir, or the PVC in spec.model.cache.claimName that replicas and restarts share);
the engine container then reads the same cache offline, with no credentials. The init
container prints JSON progress lines (the operator reads the last one from its log) and
writes its outcome as JSON to the termination message (reason and message on failure)."""
from __future__ import annotations

from ..api.spec import LLMDeploymentSpec

INIT_CONTAINER = "model-fetch"
MODEL_CACHE_VOLUME = "model-cache"
TERMINATION_LOG = "/dev/termination-log"


# An s3:// source whose prefix the operator could not list (operator/model_size.py), without
# model.cache.sizeLimit: this.
DEFAULT_S3_CACHE = 20 * 2**30
GiB = 2**30


def literal(text: str) -> str:
    """`text` as Kubernetes passes it in args and env values: "$$" is its escape for "$", so
    no "$(VAR)" in a user's string expands (to a Secret's value, say)."""
    return text.replace("$", "$$")


def cache_size(spec: LLMDeploymentSpec, model_bytes: int | None) -> int | None:
    """Bytes of the emptyDir model cache (its sizeLimit and the pods' ephemeral-storage request):
    model.cache.sizeLimit, else the model's files as listed up front (hf://, or s3:// where
    the operator could list the prefix) plus 10% and 1 GiB in whole GiB (so a figure that
    moves by a few bytes does not roll the pods), else DEFAULT_S3_CACHE. None with a PVC
    cache or a source that is not downloaded."""
    src, c = remote_source(spec), spec.model.cache
    if src is None or (c is not None and c.claim_name):
        return None
    if c is not None and c.size_limit is not None:
        from kvpilot.engine.config.quantity import parse_bytes
        return parse_bytes("model.cache.sizeLimit", c.size_limit)
    if model_bytes:
        return (-(-int(model_bytes * 1.1) // GiB) + 1) * GiB
    return DEFAULT_S3_CACHE


def remote_source(spec: LLMDeploymentSpec) -> str | None:
    src = spec.model.source
    return src if src and src.startswith(("hf://", "s3://")) else None


def pinned_source(spec: LLMDeploymentSpec, revision: str | None) -> str:
    """The source the pods fetch and load: hf:// at the commit status.model pinned."""
    src = remote_source(spec)
    if src is None:
        raise ValueError("model.source is not hf:// or s3://")
    if src.startswith("hf://"):
        if revision is None:
            raise ValueError("an hf:// source needs its resolved commit")
        return f"{src.partition('@')[0]}@{revision}"
    return src


def source_env(spec: LLMDeploymentSpec) -> list[dict]:
    """The variables huggingface_hub and boto3 read, from the spec and its Secrets."""
    m = spec.model
    env: list[dict] = []
    if m.hf is not None:
        if m.hf.endpoint:
            env.append({"name": "HF_ENDPOINT", "value": literal(m.hf.endpoint)})
        if m.hf.token_secret_ref is not None:
            ref = m.hf.token_secret_ref
            env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    if m.s3 is not None:
        if m.s3.endpoint:
            env.append({"name": "AWS_ENDPOINT_URL", "value": literal(m.s3.endpoint)})
        if m.s3.region:
            env.append({"name": "AWS_REGION", "value": literal(m.s3.region)})
        if m.s3.path_style:
            env.append({"name": "KVPILOT_S3_PATH_STYLE", "value": "1"})
        if m.s3.credentials_secret_ref is not None:
            name = m.s3.credentials_secret_ref.name
            for key, optional in (("AWS_ACCESS_KEY_ID", False), ("AWS_SECRET_ACCESS_KEY", False),
                                  ("AWS_SESSION_TOKEN", True)):
                ref = {"name": name, "key": key}
                if optional:
                    ref["optional"] = True
                env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    return env


def cache_volume(spec: LLMDeploymentSpec, size: int | None = None) -> dict:
    claim = spec.model.cache.claim_name if spec.model.cache is not None else None
    if claim:
        return {"name": MODEL_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": claim}}
    return {"name": MODEL_CACHE_VOLUME, "emptyDir": {"sizeLimit": str(size)} if size else {}}


def init_container(spec: LLMDeploymentSpec, source: str, models_dir: str, base_env: list[dict],
                   base_mounts: list[dict], security_context: dict, cache: int | None = None) -> dict:
    """`kvpilot fetch-model` with the engine's image, scratch and security context. It asks for
    the engine's CPU and memory (and the cache's ephemeral storage) but no GPU: a download
    needs none."""
    from ..api.defaults import engine_image

    args = [source, "--cache-dir", models_dir, "--json-progress", "--termination-log", TERMINATION_LOG]
    for pattern in spec.model.files:
        args += ["--include", pattern]
    r = spec.resources
    requests = {"cpu": str(r.cpu), "memory": str(r.memory)}
    if cache:
        requests["ephemeral-storage"] = str(cache)
    return {
        "name": INIT_CONTAINER, "image": engine_image(spec),
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["kvpilot", "fetch-model"], "args": [literal(a) for a in args],
        "env": base_env + source_env(spec),
        "volumeMounts": base_mounts + [{"name": MODEL_CACHE_VOLUME, "mountPath": models_dir}],
        "resources": {"requests": requests, "limits": {"memory": str(r.memory)}},
        "securityContext": security_context,
        "terminationMessagePolicy": "File",
    }
