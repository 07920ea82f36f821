"""spec.pod, spec.scheduling and spec.service: what the engine pods carry besides the engine
(pull secrets, service account, labels, security context, placement)."""
from __future__ import annotations

import json
from typing import Annotated, Literal, Optional

from pydantic import ConfigDict, Field, field_validator

from .fields import AnnotationMap, DNS_SUBDOMAIN_PATTERN, LABEL_KEY_PATTERN, LABEL_VALUE_PATTERN, LabelMap, Model


class Toleration(Model):
    """A core/v1 Toleration."""
    key: Optional[str] = Field(default=None, pattern=LABEL_KEY_PATTERN, max_length=316,
                               description="The taint key; empty with operator Exists: every taint.")
    operator: Optional[Literal["Exists", "Equal"]] = Field(default=None, description="Default Equal.")
    value: Optional[str] = Field(default=None, pattern=LABEL_VALUE_PATTERN, max_length=63,
                                 description="The taint value (operator Equal).")
    effect: Optional[Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]] = Field(
        default=None, description="The taint effect matched; empty: all.")
    toleration_seconds: Optional[int] = Field(default=None, ge=0, le=31536000,
                                              description="NoExecute: how long the pod stays once tainted.")


_TWO = {"maxProperties": 2}  # each part has two fields: required and preferred terms


class Affinity(Model):
    """A core/v1 Affinity; each part passed through as written."""
    model_config = ConfigDict(extra="forbid")
    node_affinity: Optional[dict] = Field(default=None, description="A core/v1 NodeAffinity.",
                                          json_schema_extra=_TWO)
    pod_affinity: Optional[dict] = Field(default=None, description="A core/v1 PodAffinity.",
                                         json_schema_extra=_TWO)
    pod_anti_affinity: Optional[dict] = Field(default=None, description="A core/v1 PodAntiAffinity.",
                                              json_schema_extra=_TWO)

    @field_validator("node_affinity", "pod_affinity", "pod_anti_affinity")
    @classmethod
    def _bounded(cls, v: Optional[dict]) -> Optional[dict]:
        if v is not None and len(json.dumps(v)) > 16384:
            raise ValueError("at most 16 KiB")
        return v


class Scheduling(Model):
    """Where the engine pods may run (default: the operator's, from the chart's engine values)."""
    node_selector: LabelMap = Field(default_factory=dict, description="Node labels the pods require.")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32,
                                          description="Taints the pods tolerate (e.g. nvidia.com/gpu).")
    affinity: Optional[Affinity] = Field(default=None, description=Affinity.__doc__)
    priority_class_name: Optional[str] = Field(default=None, pattern=DNS_SUBDOMAIN_PATTERN, max_length=253,
                                               description="The pods' PriorityClass.")


class PodSecurity(Model):
    """The engine pods' security context. Given, it replaces the operator's default (run as
    65532, fsGroup 65532) whole: OpenShift's restricted SCC wants {runAsNonRoot: true} alone,
    so that it assigns the ids."""
    run_as_user: Optional[int] = Field(default=None, ge=1, le=2**31 - 1, description="The UID (never 0).")
    run_as_group: Optional[int] = Field(default=None, ge=0, le=2**31 - 1, description="The GID.")
    fs_group: Optional[int] = Field(default=None, ge=0, le=2**31 - 1,
                                    description="The group volumes are made writable for.")
    supplemental_groups: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] = Field(
        default_factory=list, max_length=16, description="More groups the containers run with.")
    run_as_non_root: bool = Field(default=True, description="Refuse images that would run as root.")
    seccomp_profile_type: Literal["RuntimeDefault", "Localhost", "Unconfined"] = Field(
        default="RuntimeDefault", description="The seccomp profile (pod level and each container).")


class PodSettings(Model):
    """The engine pods' identity and metadata (default: the operator's, from the chart's
    engine values; a per-LLMDeployment value replaces it, maps are merged)."""
    image_pull_secrets: list[Annotated[str, Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)]] = Field(
        default_factory=list, max_length=16, description="Names of docker-registry Secrets the engine "
                                                         "image is pulled with (private registries).")
    service_account_name: Optional[str] = Field(
        default=None, pattern=DNS_SUBDOMAIN_PATTERN, max_length=253,
        description="The pods' ServiceAccount (IRSA, Workload Identity); its token is mounted only "
                    "when this is set. Default: the namespace's default, without a token.")
    annotations: AnnotationMap = Field(default_factory=dict, description="Extra pod annotations.")
    labels: LabelMap = Field(default_factory=dict, description="Extra pod labels (the operator's own "
                                                               "selector labels win).")
    security_context: Optional[PodSecurity] = Field(default=None, description=PodSecurity.__doc__)


class ServiceSpec(Model):
    """The Service in front of the engine pods."""
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(default="ClusterIP",
                                                                   description="The Service type.")
    port: int = Field(default=8000, ge=1, le=65535, description="The Service port.")
