"""spec.model: where the weights come from (builtin:, pvc://, file://, hf://, s3://), their
credentials and cache, and spec.engine.simulate's accelerator and model shape."""
from __future__ import annotations

from typing import Annotated, Optional

from pydantic import ConfigDict, Field

from .fields import Bytes, CONFIGMAP_KEY_PATTERN, DNS_SUBDOMAIN_PATTERN, FILE_GLOB_PATTERN, MODEL_SOURCE_LENGTHS, MODEL_SOURCE_PATTERN, Model, OUTPUT_LEN_PATTERN, SERVED_NAME_PATTERN, SimulatedAccelerator, SimulatedInterconnect, SimulatedModel, URL_PATTERN, rule


class SecretKeyRef(Model):
    """A key of a Secret in the LLMDeployment's namespace."""
    name: str = Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253, description="The Secret's name.")
    key: str = Field(pattern=CONFIGMAP_KEY_PATTERN, max_length=253, description="The key in the Secret's data.")


class HubTokenRef(Model):
    """The Secret key holding a Hugging Face token."""
    name: str = Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253, description="The Secret's name.")
    key: str = Field(default="HF_TOKEN", pattern=CONFIGMAP_KEY_PATTERN, max_length=253,
                     description="The key in the Secret's data.")


class SecretRef(Model):
    """A Secret in the LLMDeployment's namespace."""
    name: str = Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253, description="The Secret's name.")


class HubOptions(Model):
    """For hf:// sources: the Hugging Face Hub, or a mirror of it (HF_ENDPOINT)."""
    endpoint: Optional[str] = Field(
        default=None, pattern=URL_PATTERN, max_length=512,
        description="A Hub mirror's URL (as HF_ENDPOINT), e.g. https://hf-mirror.internal; "
                    "default https://huggingface.co.")
    token_secret_ref: Optional[HubTokenRef] = Field(
        default=None, description="Secret key holding a Hub token (HF_TOKEN), for private or gated "
                                  "repositories; key defaults to HF_TOKEN.")


class S3Options(Model):
    """For s3:// sources: AWS S3 or an S3-compatible store (MinIO, Ceph RGW, R2, SeaweedFS)."""
    endpoint: Optional[str] = Field(
        default=None, pattern=URL_PATTERN, max_length=512,
        description="The store's URL (AWS_ENDPOINT_URL), e.g. http://minio.storage:9000; default AWS.")
    region: Optional[str] = Field(default=None, pattern=r"^[a-z0-9-]{1,64}$", max_length=64,
                                  description="AWS_REGION; default us-east-1.")
    path_style: bool = Field(default=False, description="Path-style addressing (MinIO and most "
                                                        "self-hosted stores need it).")
    credentials_secret_ref: Optional[SecretRef] = Field(
        default=None, description="Secret with keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                                  "(and optionally AWS_SESSION_TOKEN).")


class ModelCache(Model):
    """Where an hf:// or s3:// model is downloaded to."""
    claim_name: Optional[str] = Field(
        default=None, pattern=DNS_SUBDOMAIN_PATTERN, max_length=253,
        description="A PersistentVolumeClaim that holds downloaded models, shared by replicas and "
                    "restarts (ReadWriteMany for pods on several nodes); default: an emptyDir per pod.")
    size_limit: Optional[Bytes] = Field(
        default=None,
        description="The emptyDir cache's sizeLimit and the pods' ephemeral-storage request (e.g. "
                    "40Gi); default: the model's files (listed up front) plus 10% and 1Gi, or 20Gi for an "
                    "s3:// prefix the operator cannot list (status.model.sizing says why). "
                    "Unused with claimName.")


class ModelSource(Model):
    """What to serve: where the weights come from and the name clients ask for."""
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        rule(MODEL_SOURCE_LENGTHS[0], "model.source: a Hub organisation or name is at most 96 "
             "characters, a revision at most 255", ".source"),
        rule(MODEL_SOURCE_LENGTHS[1], "model.source: an S3 bucket name is 3-63 characters", ".source"),
        rule("!has(self.hf) || (has(self.source) && self.source.startsWith('hf://'))",
             "model.hf applies to hf:// sources only", ".hf"),
        rule("!has(self.s3) || (has(self.source) && self.source.startsWith('s3://'))",
             "model.s3 applies to s3:// sources only", ".s3"),
        rule("(!has(self.cache) && size(self.files) == 0) || (has(self.source) && "
             "(self.source.startsWith('hf://') || self.source.startsWith('s3://')))",
             "model.cache and model.files apply to hf:// and s3:// sources only", ".cache"),
    ]})
    source: Optional[str] = Field(
        default=None, pattern=MODEL_SOURCE_PATTERN, max_length=1024,
        description="builtin:tiny, hf://ORG/NAME[@REVISION] (the Hugging Face Hub or a mirror; "
                    "the revision is pinned to a commit in status.model), s3://BUCKET/PREFIX, "
                    "pvc://CLAIM/PATH (mounted read-only at /models), file:///PATH or /PATH (a "
                    "path inside the image). Required unless engine.simulate is set.")
    served_name: Optional[str] = Field(
        default=None, pattern=SERVED_NAME_PATTERN, max_length=253,
        description="The model name clients send (letters, digits and . _ : / @ + -); defaults to "
                    "the LLMDeployment's name.")
    hf: Optional[HubOptions] = Field(default=None, description="Options for an hf:// source.")
    s3: Optional[S3Options] = Field(default=None, description="Options for an s3:// source.")
    cache: Optional[ModelCache] = Field(default=None, description="Where an hf:// or s3:// model is "
                                                                  "downloaded to.")
    files: list[Annotated[str, Field(pattern=FILE_GLOB_PATTERN, max_length=255)]] = Field(
        default_factory=list, max_length=32,
        description="More files to download from hf:// or s3:// (globs such as 'original/*' or "
                    "'*.bin'); by default only config, tokenizer and *.safetensors files.")


class ConfigMapKeyRef(Model):
    """A key of a ConfigMap in the LLMDeployment's namespace."""
    name: str = Field(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253, description="The ConfigMap's name.")
    key: str = Field(default="config.json", pattern=CONFIGMAP_KEY_PATTERN, max_length=253,
                     description="The key in the ConfigMap's data.")


SIMULATE_NEEDS_MODEL = ("engine.simulate needs model (a preset such as llama-3.1-8b) or modelConfigMap "
                        "(a config.json); the shape is not read from model.source")


class SimulateSpec(Model):
    """A simulated accelerator: the real server, scheduler, KV cache manager and metrics,
    with the forward pass replaced by a timing model (no GPU, no weights)."""
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        rule("!(has(self.model) && has(self.modelConfigMap))",
             "engine.simulate.model and engine.simulate.modelConfigMap are mutually exclusive",
             ".modelConfigMap"),
        rule("has(self.model) || has(self.modelConfigMap)", SIMULATE_NEEDS_MODEL),
    ]})
    accelerator: SimulatedAccelerator = Field(description="The accelerator to model.")
    model: Optional[SimulatedModel] = Field(
        default=None, description="The model shape to model, a preset; or give modelConfigMap.")
    model_config_map: Optional[ConfigMapKeyRef] = Field(
        default=None, description="A ConfigMap holding a Hugging Face config.json under key "
                                  "(mounted read-only); or give model.")
    output_len: Optional[str] = Field(
        default=None, pattern=OUTPUT_LEN_PATTERN, max_length=64,
        description="Where EOS comes for requests that do not ignore it: fixed:N, uniform:LO:HI, "
                    "exponential:MEAN or lognormal:MEDIAN:SIGMA (the engine's default: "
                    "lognormal:256:1.0).")
    load_seconds: Optional[float] = Field(
        default=None, ge=0, le=3600,
        description="Seconds the simulated model takes to load before the pod is ready (a real 8B "
                    "model: about a minute); default 0.")
    interconnect: Optional[SimulatedInterconnect] = Field(
        default=None, description="With more than one GPU an engine (tensor parallelism): the link its "
                                  "all-reduces cross, nvlink4 (H100/H200 SXM), nvlink3 (A100 SXM), pcie5 "
                                  "or pcie4; default the accelerator's.")
