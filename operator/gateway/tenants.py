"""Tenants: who may call the gateway (API keys, from Secrets mounted as files), which
models each may use, its rate limits and its priority in the gateway's queue.

The tenants file (YAML; the chart renders it from `gateway.tenants`):

    window: 60                      # seconds the limits count over
    tenants:
      - name: search
        apiKeyFiles: [/etc/kvpilot/gateway/keys/search/api-key]
        models: ["llama-8b", "qwen-*"]   # shell-style globs; omitted: every model
        requestsPerWindow: 600
        tokensPerWindow: 200000
        priority: 10                # higher is served first when replicas are saturated

Without a tenants file the gateway is open: every request is the tenant `anonymous`, with
no limits, as the engines' own endpoints are without --api-key."""
from __future__ import annotations

import fnmatch
import hashlib
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

ANONYMOUS = "anonymous"


class TenantSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    api_key_files: list[str] = Field(alias="apiKeyFiles", min_length=1)
    models: list[str] = Field(default_factory=lambda: ["*"])
    requests_per_window: int | None = Field(default=None, alias="requestsPerWindow", ge=1, le=10**9)
    tokens_per_window: int | None = Field(default=None, alias="tokensPerWindow", ge=1, le=10**12)
    priority: int = Field(default=0, ge=-1000, le=1000)


class TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    window: float = Field(default=60.0, gt=0, le=86400)
    tenants: list[TenantSpec] = Field(default_factory=list)

    @field_validator("tenants")
    @classmethod
    def _unique_names(cls, tenants: list[TenantSpec]) -> list[TenantSpec]:
        names = [t.name for t in tenants]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"tenant names must be unique; repeated: {', '.join(dupes)}")
        return tenants


@dataclass(frozen=True)
class Tenant:
    name: str
    models: tuple[str, ...]
    requests_per_window: int | None
    tokens_per_window: int | None
    priority: int

    def may_use(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)


OPEN_TENANT = Tenant(ANONYMOUS, ("*",), None, None, 0)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Tenants:
    """API key -> tenant. Keys are held as SHA-256 digests, never logged."""

    def __init__(self, tenants: list[Tenant], keys: dict[bytes, Tenant], window: float) -> None:
        self.tenants = tenants
        self._keys = keys
        self.window = window

    @property
    def open(self) -> bool:
        return not self.tenants

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant of an `Authorization: Bearer KEY` header; None for no or unknown key."""
        if self.open:
            return OPEN_TENANT
        if not authorization or not authorization.lower().startswith("bearer "):
            return None
        return self._keys.get(_digest(authorization[7:].strip()))

    @classmethod
    def unrestricted(cls) -> "Tenants":
        return cls([], {}, 60.0)

    @classmethod
    def load(cls, path: str | Path) -> "Tenants":
        """Read and check the tenants file and every key file it names; ValueError names
        the field or file at fault."""
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"tenants file {path}: {e}") from None
        try:
            parsed = TenantsFile.model_validate(raw)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise ValueError(f"tenants file {path}: {where}: {err['msg']}") from None
        tenants, keys = [], {}
        for spec in parsed.tenants:
            tenant = Tenant(spec.name, tuple(spec.models), spec.requests_per_window,
                            spec.tokens_per_window, spec.priority)
            tenants.append(tenant)
            for key_file in spec.api_key_files:
                try:
                    key = Path(key_file).read_text().strip()
                except OSError as e:
                    raise ValueError(f"tenants file {path}: tenant {spec.name}: apiKeyFiles: {e}") from None
                if len(key) < 16:
                    raise ValueError(f"tenants file {path}: tenant {spec.name}: the key in {key_file} "
                                     f"is shorter than 16 characters")
                other = keys.setdefault(_digest(key), tenant)
                if other is not tenant:
                    raise ValueError(f"tenants file {path}: tenants {other.name} and {spec.name} share "
                                     f"an API key ({key_file})")
        return cls(tenants, keys, parsed.window)
