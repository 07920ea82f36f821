"""The LLMDeployment API's building blocks: the pydantic base model with camelCase names, the
patterns and bounds every field uses (shared with the CRD through the models), CEL rules, and
the error an unusable spec raises."""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr
from pydantic.alias_generators import to_camel

from kvpilot.engine.fetch.uri import BUILTIN_NAME, DNS_SUBDOMAIN, HF_URI, REL_PATH, S3_URI  # the parser's own pieces
from ..names import GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION  # noqa: F401  (the API's names)


PROJECT_VERSION = "0.1.0"
DEFAULT_IMAGE = f"kvpilot/engine:{PROJECT_VERSION}"
# Simulated pods (engine.simulate) run the operator's image: the server without torch.
DEFAULT_SIMULATED_IMAGE = f"kvpilot/operator:{PROJECT_VERSION}"
QUANTITY_PATTERN = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
# Bounded digits: a duration the autotuner's parser reads without overflowing.
DURATION_PATTERN = r"^([0-9]{1,6}(ms|s|m|h)){1,4}$"
# Kubernetes expands $(VAR) in container args and env values (and reads $$ as a literal $):
# a spec string that reaches them may not contain "$(", nor control characters. The builders
# escape every "$" of a user's string as "$$" too, for objects stored before this rule.
NO_EXPANSION = r"([^$\x00-\x1f\x7f]|\$+[^$(\x00-\x1f\x7f])*\$*"
SAFE_TEXT_PATTERN = rf"^{NO_EXPANSION}$"
# The model URIs, built from the pieces kvpilot.engine.fetch.uri parses them with.
MODEL_SOURCE_PATTERN = (rf"^(builtin:{BUILTIN_NAME}|pvc://{DNS_SUBDOMAIN}(/|/{REL_PATH}/?)?|file:///{REL_PATH}/?"
                        rf"|/{REL_PATH}/?|{HF_URI}|{S3_URI})$")
# The lengths a pattern cannot bound (the Hub's 96-character names; S3's 3-63-character buckets).
MODEL_SOURCE_LENGTHS = ("!has(self.source) || !self.source.startsWith('hf://') || "
                        "self.source.matches('^hf://[^/@]{1,96}/[^/@]{1,96}(@.{1,255})?$')",
                        "!has(self.source) || !self.source.startsWith('s3://') || "
                        "self.source.matches('^s3://[^/]{3,63}(/.*)?$')")
URL_PATTERN = r"^https?://[^$\x00-\x20\x7f]+$"
FILE_GLOB_PATTERN = r"^[^$\x00-\x20\x7f]{1,255}$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = rf"^{DNS_SUBDOMAIN}$"
CONFIGMAP_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
# A served model name: what clients send as "model" (and a Prometheus label value).
SERVED_NAME_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._:/@+-]*[A-Za-z0-9])?$"
# A draft model: builtin:NAME, or a path inside the image or the model volume (/models for pvc://).
DRAFT_MODEL_PATTERN = rf"^(builtin:{BUILTIN_NAME}|file:///{REL_PATH}|/{REL_PATH})$"
# Byte sizes both Kubernetes and the engine's parser (engine/config/quantity.py) read, from 1 MB up:
# a bare count of at least 7 digits, or a mantissa with a binary or decimal suffix.
BYTES_PATTERN = r"^([1-9][0-9]{6,15}|[1-9][0-9]{0,4}(\.[0-9]{1,3})?(Mi|Gi|Ti|M|G|T))$"
BYTES_MIN, BYTES_MAX = 10**6, 2**50
# CPU: cores (0.5, 2) or millicores (500m); never zero or negative.
CPU_PATTERN = r"^([1-9][0-9]{0,3}(\.[0-9]{1,3})?|0\.[0-9]{0,2}[1-9][0-9]{0,2}|[1-9][0-9]{0,6}m)$"
# Kubernetes label keys (qualified names) and values; annotation keys are qualified names too.
LABEL_KEY = (rf"({DNS_SUBDOMAIN}/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
LABEL_KEY_PATTERN = rf"^{LABEL_KEY}$"
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
# An image reference: [registry[:port]/]path[:tag][@digest], no spaces or '$'.
IMAGE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$"
EXTENDED_RESOURCE_PATTERN = rf"^{DNS_SUBDOMAIN}/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
MAX_SPECULATIVE_TOKENS = 16  # the engine's limit (engine/config/speculative.py)
PROMPT_LOOKUP_DEFAULTS = (1, 4)  # the engine's (min, max) when the spec leaves them out
# A positive number (no zero: the engine rejects it), then the distributions `kvpilot serve
# --simulate-output-len` takes; uniform's LO <= HI is checked in validate_spec.
_POSITIVE = r"([0-9]*[1-9][0-9]*(\.[0-9]+)?|[0-9]*\.[0-9]*[1-9][0-9]*)"
OUTPUT_LEN_PATTERN = (rf"^(fixed:{_POSITIVE}|exponential:{_POSITIVE}"
                      rf"|uniform:{_POSITIVE}:{_POSITIVE}|lognormal:{_POSITIVE}:{_POSITIVE})$")
# The engine's presets (engine/sim/hardware.py and shapes.py; a test keeps them equal).
SimulatedAccelerator = Literal["h200", "h100-80gb", "a100-80gb", "l40s", "l4", "a10g"]
SimulatedModel = Literal["llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "mistral-7b"]
SimulatedInterconnect = Literal["nvlink4", "nvlink3", "pcie5", "pcie4"]
MAX_PARALLEL_SIZE = 16  # the engine's (engine/config/engine.py) and resources.gpus' limit


def quantity(pattern: str, lo: int, hi: int) -> type:
    """An int-or-string Kubernetes quantity: an integer in [lo, hi] or a string matching
    `pattern` (crd.py renders both branches' bounds on one x-kubernetes-int-or-string node)."""
    return Union[Annotated[StrictInt, Field(ge=lo, le=hi)], Annotated[StrictStr, Field(pattern=pattern, max_length=24)]]


Bytes = quantity(BYTES_PATTERN, BYTES_MIN, BYTES_MAX)
Cpu = quantity(CPU_PATTERN, 1, 1024)
SafeText = Annotated[str, Field(pattern=SAFE_TEXT_PATTERN, max_length=1024)]
LabelKey = Annotated[str, Field(pattern=LABEL_KEY_PATTERN, max_length=316)]


def rule(expr: str, message: str, field_path: str | None = None) -> dict:
    out = {"rule": expr, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


class Model(BaseModel):
    # camelCase names on the wire; unknown fields ignored (the API server prunes them).

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    def dump(self) -> dict:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# A map's keys are checked for length only at the API server: the CEL cost estimator takes an
# unbounded length for map keys, so a regex over them would exceed the CRD's cost budget. Their
# form (a qualified name) is checked by pydantic, and by the API server on the pods themselves.
LabelMap = Annotated[dict[LabelKey, Annotated[str, Field(pattern=LABEL_VALUE_PATTERN, max_length=63)]],
                     Field(max_length=32)]
AnnotationMap = Annotated[dict[LabelKey, Annotated[str, Field(max_length=4096)]], Field(max_length=32)]


class InvalidSpec(ValueError):
    """A spec the operator cannot use (PermanentError in the handlers)."""
