"""What the operator fills in where an LLMDeployment leaves a field out: its own configuration
(`kvpilot operator --engine-image ...`, the chart's engine values), read at each reconcile."""
from __future__ import annotations

from typing import Optional

from pydantic import Field

from .fields import DEFAULT_IMAGE, DEFAULT_SIMULATED_IMAGE, EXTENDED_RESOURCE_PATTERN, IMAGE_PATTERN, Model, URL_PATTERN
from .pod import PodSettings, Scheduling
from .spec import DEFAULT_PROMETHEUS_URL, LLMDeploymentSpec


DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
DEFAULTS_ENV = "KVPILOT_ENGINE_DEFAULTS"  # the operator's OperatorDefaults as JSON (the CLI sets it)


class OperatorDefaults(Model):
    """What the operator fills in where an LLMDeployment leaves a field out (`kvpilot operator
    --engine-image`, `--engine-defaults`; the chart's engine values): read at each reconcile,
    so `helm upgrade` reaches every engine pod."""
    engine_image: Optional[str] = Field(default=None, pattern=IMAGE_PATTERN, max_length=512)
    simulated_image: Optional[str] = Field(default=None, pattern=IMAGE_PATTERN, max_length=512)
    gpu_resource_name: Optional[str] = Field(default=None, pattern=EXTENDED_RESOURCE_PATTERN, max_length=253)
    prometheus_url: Optional[str] = Field(default=None, pattern=URL_PATTERN, max_length=1024)
    pod: PodSettings = Field(default_factory=PodSettings)
    scheduling: Scheduling = Field(default_factory=Scheduling)

    @classmethod
    def from_env(cls, environ: dict) -> "OperatorDefaults":
        text = environ.get(DEFAULTS_ENV, "").strip()
        return cls.model_validate_json(text) if text else cls()


def engine_image(spec: LLMDeploymentSpec, d: OperatorDefaults | None = None) -> str:
    """The engine container's image: the spec's, else the operator's (a simulated engine runs
    the torch-free operator image, a real one the engine image)."""
    d = d or OperatorDefaults()
    if spec.engine.image:
        return spec.engine.image
    if spec.engine.simulate is not None:
        return d.simulated_image or DEFAULT_SIMULATED_IMAGE
    return d.engine_image or DEFAULT_IMAGE


def with_defaults(spec: LLMDeploymentSpec, d: OperatorDefaults) -> LLMDeploymentSpec:
    """`spec` with the operator's defaults where it names nothing: scalars and lists are
    replaced whole, annotations and labels merged (the spec's win)."""
    e, r, p, s, at = spec.engine, spec.resources, spec.pod, spec.scheduling, spec.autotune
    url = at.prometheus.url or d.prometheus_url or DEFAULT_PROMETHEUS_URL
    return spec.model_copy(update={
        "autotune": at.model_copy(update={"prometheus": at.prometheus.model_copy(update={"url": url})}),
        "engine": e.model_copy(update={"image": engine_image(spec, d)}),
        "resources": r.model_copy(update={
            "gpu_resource_name": r.gpu_resource_name or d.gpu_resource_name or DEFAULT_GPU_RESOURCE}),
        "pod": p.model_copy(update={
            "image_pull_secrets": p.image_pull_secrets or d.pod.image_pull_secrets,
            "service_account_name": p.service_account_name or d.pod.service_account_name,
            "annotations": {**d.pod.annotations, **p.annotations}, "labels": {**d.pod.labels, **p.labels},
            "security_context": p.security_context or d.pod.security_context}),
        "scheduling": s.model_copy(update={
            "node_selector": s.node_selector or d.scheduling.node_selector,
            "tolerations": s.tolerations or d.scheduling.tolerations,
            "affinity": s.affinity or d.scheduling.affinity,
            "priority_class_name": s.priority_class_name or d.scheduling.priority_class_name}),
    })
