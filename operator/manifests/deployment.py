"""The pure builder of the engine Deployment. Live settings (max_num_seqs,
max_model_len, num_speculative_tokens) are not in the pod template: they reach the pods through the
tuning ConfigMap, so changing them never rolls pods. Everything else is in the
template and its hash annotation, so changing it does."""
from __future__ import annotations

import hashlib
import json

from kvpilot.engine.config.quantity import parse_bytes

from .model_download import (MODEL_CACHE_VOLUME, cache_size, cache_volume, init_container, literal, pinned_source,
                             remote_source)
from .objects import (HTTP_PORT, TUNING_DIR, TUNING_FILE, Owner, metadata, selector_labels,
                      tuning_configmap_name)
from ..api.parallel import parallel_args, parallel_sizes
from .simulate import SIMULATED_LABEL, sim_model_projection, simulate_args
from ..api.defaults import DEFAULT_GPU_RESOURCE, engine_image
from ..api.spec import LLMDeploymentSpec

CONTAINER = "engine"
HASH_ANNOTATION = "serving.kvpilot.dev/config-hash"
MODELS_DIR = "/models"
# Writable scratch for the read-only root filesystem (TMPDIR and HOME point here); the
# chart's operator pod uses the same path.
SCRATCH_DIR = "/scratch"
CACHE_DIR = "/var/cache/kvpilot"
MODELS_CACHE_DIR = f"{CACHE_DIR}/models"  # hf:// and s3:// models (model_download.py)
# The pod's own writable space, bounded so no writer can fill a node's disk (the root
# filesystem is read-only): scratch is HOME and TMPDIR (torch's and Triton's caches,
# temporary files), cache the compiled kernels. The container requests SCRATCH_REQUEST of
# ephemeral storage for them and its logs, plus the model cache it downloads into.
SCRATCH_LIMIT, KERNEL_CACHE_LIMIT, SCRATCH_REQUEST = "4Gi", "2Gi", 2**30
RUN_AS = 65532
PRESTOP_SLEEP_S = 5
SECCOMP = {"type": "RuntimeDefault"}
# After preStop and the engine's drain (--drain-timeout): the process's own exit (uvicorn's
# shutdown, freeing the GPU) before the kubelet's SIGKILL.
EXIT_MARGIN_S = 5
# Every address of the pod, loopback included: `kubectl port-forward` connects to localhost in
# the pod's network namespace, probes and Services to the pod IP. IPv4 (an IPv6-only cluster is
# not supported yet: docs/kubernetes.md).
LISTEN_HOST = "0.0.0.0"


def grace_period(spec: LLMDeploymentSpec) -> int:
    """terminationGracePeriodSeconds: preStop, then the drain, then the exit, so a stream that
    finishes within engine.drainTimeoutSeconds is never cut."""
    return PRESTOP_SLEEP_S + spec.engine.drain_timeout_seconds + EXIT_MARGIN_S


def model_source(source: str) -> tuple[str, dict | None, dict | None]:
    """(--model argument, volume, volumeMount) for a spec.model.source."""
    if source.startswith("pvc://"):
        claim, _, path = source[len("pvc://"):].partition("/")
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        mount = {"name": "model", "mountPath": MODELS_DIR, "readOnly": True}
        return (f"{MODELS_DIR}/{path.strip('/')}" if path.strip("/") else MODELS_DIR), volume, mount
    if source.startswith("file://"):
        return source[len("file://"):], None, None
    return source, None, None


def pvc_claim(spec: LLMDeploymentSpec) -> str | None:
    src = spec.model.source
    return src[len("pvc://"):].partition("/")[0] if src and src.startswith("pvc://") else None


# A CPU engine's KV cache lives in the pod's memory beside the weights and the Python
# process, so the engine's own CPU default (1Gi) would get a 1Gi pod OOM-killed.
CPU_ENGINE_OVERHEAD = 768 * 2**20  # bytes left for the process, weights and activations
CPU_KV_CACHE_MIN, CPU_KV_CACHE_MAX = 64 * 2**20, 2**30


def cpu_kv_cache_memory(spec: LLMDeploymentSpec) -> int | None:
    """The KV cache a real CPU engine gets when the spec names none: the pod's memory limit
    less CPU_ENGINE_OVERHEAD, within [64Mi, 1Gi]. None for GPU and simulated engines (they
    size the cache from the device)."""
    if spec.resources.gpus or spec.engine.simulate is not None:
        return None
    try:
        limit = parse_bytes("resources.memory", str(spec.resources.memory))
    except ValueError:  # a quantity the engine's parser does not read ("1e9"): its own default
        return None
    return min(max(limit - CPU_ENGINE_OVERHEAD, CPU_KV_CACHE_MIN), CPU_KV_CACHE_MAX)


def engine_args(owner: Owner, spec: LLMDeploymentSpec, model_arg: str | None) -> list[str]:
    """`kvpilot serve` flags; model_arg is None for a simulated spec without model.source."""
    e = spec.engine
    args = ["--model", model_arg] if model_arg is not None else []
    args += ["--served-model-name", spec.model.served_name or owner.name,
             "--host", LISTEN_HOST, "--port", str(HTTP_PORT), "--drain-timeout", str(e.drain_timeout_seconds),
             "--tuning-file", f"{TUNING_DIR}/{TUNING_FILE}",
             # Start-up floor only: the tuning file (read before serving) sets the live
             # values, so they stay out of the pod template and never roll pods.
             "--max-model-len", str(spec.autotune.max_model_len.min),
             "--dtype", e.dtype, "--max-num-batched-tokens", str(e.max_num_batched_tokens),
             "--block-size", str(e.block_size),
             "--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching"]
    if e.kv_cache_memory is not None:
        args += ["--kv-cache-memory", str(e.kv_cache_memory)]
    elif e.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(e.gpu_memory_utilization)]
    elif (cpu_kv := cpu_kv_cache_memory(spec)) is not None:
        args += ["--kv-cache-memory", str(cpu_kv)]
    args += parallel_args(spec)  # resources.gpus' GPUs for one engine (or the spec's split of them)
    if e.simulate is not None:
        args += simulate_args(e.simulate)
    if e.speculative is not None:  # K here is the most; the tuning file sets the value in effect
        args += ["--speculative-config", json.dumps(e.speculative.engine_config(), sort_keys=True)]
    if e.quantization is not None:
        args += ["--quantization", e.quantization]
    if e.kv_cache_dtype is not None:
        args += ["--kv-cache-dtype", e.kv_cache_dtype]
    # Every string so far is literal (Kubernetes reads $$ as $): a spec's "$(VAR)" never expands.
    args = [literal(a) for a in args + list(e.extra_args)]
    if e.api_key_secret_ref is not None:  # the one reference meant to expand (the Secret's key)
        args += ["--api-key", "$(KVPILOT_API_KEY)"]
    return args


def resources(spec: LLMDeploymentSpec, model_cache: int | None = None) -> dict:
    """model_cache: the emptyDir model cache's bytes, requested as ephemeral storage."""
    r = spec.resources
    requests = {"cpu": str(r.cpu), "memory": str(r.memory)}
    limits = {"memory": str(r.memory)}
    if r.gpus:
        name = r.gpu_resource_name or DEFAULT_GPU_RESOURCE
        requests[name] = limits[name] = str(r.gpus)
    requests["ephemeral-storage"] = str(SCRATCH_REQUEST + (model_cache or 0))
    return {"requests": requests, "limits": limits}


def rollout_strategy(spec: LLMDeploymentSpec) -> dict:
    """GPU pods replace in place (no surge pod that would wait forever for a
    GPU); CPU pods surge one so serving never drops (a surge that cannot be
    scheduled stalls the rollout with old pods still serving, and
    progressDeadlineSeconds turns that into Degraded)."""
    if spec.resources.gpus > 0:
        return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


def _probe(path: str, period: int, failures: int, timeout: int = 5) -> dict:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": timeout}


def pod_security_context(spec: LLMDeploymentSpec) -> dict:
    """spec.pod.securityContext (the operator's default in it) or 65532 throughout."""
    sc = spec.pod.security_context
    if sc is None:
        return {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
                "seccompProfile": SECCOMP}
    out = {"runAsNonRoot": sc.run_as_non_root, "seccompProfile": {"type": sc.seccomp_profile_type}}
    for key, value in (("runAsUser", sc.run_as_user), ("runAsGroup", sc.run_as_group), ("fsGroup", sc.fs_group)):
        if value is not None:
            out[key] = value
    if sc.supplemental_groups:
        out["supplementalGroups"] = list(sc.supplemental_groups)
    return out


def container_security_context(spec: LLMDeploymentSpec | None = None) -> dict:
    """The containers run as the pod does (its ids are inherited), and may do nothing more."""
    pod = pod_security_context(spec) if spec is not None else {"runAsNonRoot": True, "seccompProfile": SECCOMP}
    return {"runAsNonRoot": pod["runAsNonRoot"], "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": pod["seccompProfile"]}


def tuning_volume(owner: Owner, spec: LLMDeploymentSpec) -> dict:
    """The tuning file's ConfigMap at TUNING_DIR; with a simulated model's config.json from a
    ConfigMap, one projected volume holding both (see simulate.sim_model_projection)."""
    tuning = {"name": tuning_configmap_name(owner)}
    sim = spec.engine.simulate
    extra = sim_model_projection(sim) if sim is not None else None
    if extra is None:
        return {"name": "tuning", "configMap": tuning}
    return {"name": "tuning", "projected": {"sources": [{"configMap": tuning}, extra]}}


def build_pod_template(owner: Owner, spec: LLMDeploymentSpec, model_revision: str | None = None,
                       model_bytes: int | None = None) -> dict:
    """model_revision: the commit an hf:// source resolved to (status.model.revision);
    model_bytes: its files' size (status.model.bytesTotal), which sizes an emptyDir cache."""
    remote = remote_source(spec)
    cache = cache_size(spec, model_bytes)
    if remote is not None:  # fetched by the init container, read offline from the cache
        model_arg, model_volume = pinned_source(spec, model_revision), cache_volume(spec, cache)
        model_mount = {"name": MODEL_CACHE_VOLUME, "mountPath": MODELS_CACHE_DIR, "readOnly": True}
    else:
        model_arg, model_volume, model_mount = (model_source(spec.model.source) if spec.model.source
                                                else (None, None, None))
    simulated = spec.engine.simulate is not None
    base_env = [{"name": "HOME", "value": SCRATCH_DIR}, {"name": "TMPDIR", "value": SCRATCH_DIR},
                {"name": "KVPILOT_CACHE_DIR", "value": CACHE_DIR}]
    env = list(base_env)
    if remote is not None:
        env.append({"name": "KVPILOT_MODEL_OFFLINE", "value": "1"})
    if spec.engine.api_key_secret_ref is not None:
        ref = spec.engine.api_key_secret_ref
        env.append({"name": "KVPILOT_API_KEY",
                    "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    mounts = [{"name": "tuning", "mountPath": TUNING_DIR, "readOnly": True},
              {"name": "tmp", "mountPath": SCRATCH_DIR},
              {"name": "cache", "mountPath": CACHE_DIR}]
    volumes = [tuning_volume(owner, spec),
               {"name": "tmp", "emptyDir": {"sizeLimit": SCRATCH_LIMIT}},
               {"name": "cache", "emptyDir": {"sizeLimit": KERNEL_CACHE_LIMIT}}]
    if model_volume is not None:
        mounts.append(model_mount)
        volumes.append(model_volume)
    # NCCL and torch use shared memory, and so do a CPU engine's ranks (engine/parallel/
    # shm_channel.py: a runtime's default 64 MiB /dev/shm would send them back to gloo);
    # the simulator uses none.
    if (spec.resources.gpus > 0 or parallel_sizes(spec) != (1, 1)) and not simulated:
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    container = {
        "name": CONTAINER, "image": engine_image(spec),
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["kvpilot", "serve"], "args": engine_args(owner, spec, model_arg),
        "env": env, "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        # Model loads can be slow: up to 15 minutes before liveness applies. Asked every
        # second, so a pod takes traffic about when its server is up (every 5 s, it took
        # about 2.7 s more: 6.4 s from creation to Ready against 3.7 s, on a simulated pod).
        "startupProbe": _probe("/health", 1, 900),
        # Readiness is /health (503 once the engine failed or while draining: no new
        # requests); liveness only asks that the server answer (/version), so a pod that
        # drains, or whose engine failed and exits on its own, is not also killed.
        "readinessProbe": _probe("/health", 5, 3),
        "livenessProbe": _probe("/version", 10, 6),
        "resources": resources(spec, cache), "securityContext": container_security_context(spec),
        "volumeMounts": mounts,
        # A Service's endpoints (and any router's pod list) drop a deleted pod a moment after
        # the kubelet starts stopping it; serving a few seconds more before SIGTERM means no
        # request is sent to a server that already refuses new work.
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}},
        # A crash leaves the log's tail in the termination message, which Degraded quotes
        # (pod_health.py): the reason an engine will not start, without kubectl logs.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    sched, pod = spec.scheduling, spec.pod
    pod_spec: dict = {
        # A token only for a ServiceAccount the spec names (IRSA, Workload Identity, Vault).
        "automountServiceAccountToken": pod.service_account_name is not None, "enableServiceLinks": False,
        "terminationGracePeriodSeconds": grace_period(spec),
        "securityContext": pod_security_context(spec),
        "containers": [container], "volumes": volumes,
    }
    if pod.service_account_name:
        pod_spec["serviceAccountName"] = pod.service_account_name
    if pod.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in pod.image_pull_secrets]
    if remote is not None:
        scratch = [{"name": "tmp", "mountPath": SCRATCH_DIR}]
        pod_spec["initContainers"] = [init_container(spec, model_arg, MODELS_CACHE_DIR, base_env, scratch,
                                                     container_security_context(spec), cache)]
    if sched.node_selector:
        pod_spec["nodeSelector"] = dict(sched.node_selector)
    if sched.tolerations:
        pod_spec["tolerations"] = [t.dump() for t in sched.tolerations]
    if sched.affinity is not None and sched.affinity.dump():
        pod_spec["affinity"] = sched.affinity.dump()
    else:  # soft: replicas on different nodes where they can be (one node's loss, fewer lost)
        pod_spec["affinity"] = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                               "labelSelector": {"matchLabels": selector_labels(owner)}}}]}}
    if sched.priority_class_name:
        pod_spec["priorityClassName"] = sched.priority_class_name
    annotations = {**pod.annotations, "prometheus.io/scrape": "true", "prometheus.io/port": str(HTTP_PORT),
                   "prometheus.io/path": "/metrics"}
    pod_labels = {**pod.labels, **metadata(owner, owner.name)["labels"]}
    if simulated:
        pod_labels[SIMULATED_LABEL] = "true"
    template = {"metadata": {"labels": pod_labels, "annotations": annotations},
                "spec": pod_spec}
    annotations[HASH_ANNOTATION] = config_hash(template)
    return template


def config_hash(template: dict) -> str:
    """Hash of the non-live settings as rendered into the pod template."""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]


def build_deployment(owner: Owner, spec: LLMDeploymentSpec, replicas: int,
                     model_revision: str | None = None, model_bytes: int | None = None) -> dict:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata(owner, owner.name),
        "spec": {"replicas": replicas, "selector": {"matchLabels": selector_labels(owner)},
                 "revisionHistoryLimit": 3, "progressDeadlineSeconds": 1200,
                 "strategy": rollout_strategy(spec),
                 "template": build_pod_template(owner, spec, model_revision, model_bytes)},
    }
