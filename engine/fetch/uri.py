"""Remote model sources, parsed and checked once: `hf://ORG/NAME[@REVISION]` (the Hugging
Face Hub or a mirror of it) and `s3://BUCKET[/PREFIX]` (any S3-compatible store).

Which files a model needs is decided here too, so the engine, `kvpilot fetch-model` and the
operator agree: what the engine reads (config, tokenizer, safetensors and their index),
never pickled weights (`*.bin`, `*.pth`) unless a pattern asks for them."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

HF_SCHEME = "hf://"
S3_SCHEME = "s3://"

# The pieces of every model URI, shared with the operator's CRD (kvpilot/operator/spec.py builds
# its patterns from them, so the API server, pydantic and this parser agree). Each runs the same
# under Python's re, Rust's regex (pydantic) and Go's RE2 (the API server): no look-arounds.
# Hub repository ids: ORG/NAME, each part letters, digits, '_', with single '-' or '.' between
# them (the Hub refuses '--' and '..' and a name that starts or ends with '-' or '.'), 1-96 long.
HUB_PART = r"[A-Za-z0-9_]+([.-][A-Za-z0-9_]+)*"
# A revision (branch, tag or commit) as git allows refs: '/'-separated parts, none empty, none
# starting or ending with '.', no '..' (so never an absolute path or a step out of a cache).
HUB_REVISION_PART = r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*"
HUB_REV = rf"{HUB_REVISION_PART}(/{HUB_REVISION_PART})*"
# S3 bucket names (the AWS rules, which MinIO, Ceph and R2 follow): dot-separated labels of
# lowercase letters, digits and '-', 3-63 characters.
S3_BUCKET_NAME = r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*"
# A relative path: '/'-separated parts, none empty, '.' or '..', without '$', spaces or
# control characters (so never a step out of a mount or a cache).
_PATH_CHAR, _NOT_DOT = r"[^/$\x00-\x20\x7f]", r"[^/.$\x00-\x20\x7f]"
PATH_PART = rf"({_NOT_DOT}|{_NOT_DOT}{_PATH_CHAR}|\.{_NOT_DOT}|{_PATH_CHAR}{{3,}})"
REL_PATH = rf"{PATH_PART}(/{PATH_PART})*"
DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
BUILTIN_NAME = r"[a-z0-9]+(-[a-z0-9]+)*"
HF_URI = rf"hf://{HUB_PART}/{HUB_PART}(@{HUB_REV})?"
S3_URI = rf"s3://{S3_BUCKET_NAME}(/|/{REL_PATH}/?)?"
HUB_REPO = re.compile(rf"^{HUB_PART}/{HUB_PART}$")
HUB_REVISION = re.compile(rf"^{HUB_REV}$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
S3_BUCKET = re.compile(rf"^{S3_BUCKET_NAME}$")
S3_PREFIX = re.compile(rf"^({REL_PATH})?$")

# Top-level files the engine reads. Subfolders (original/, onnx/) are never fetched unless
# a pattern names them.
DEFAULT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json",
                 "merges.txt", "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
                 "*.safetensors", "model.safetensors.index.json")
REQUIRED_FILE = "config.json"


@dataclass(frozen=True)
class HubSource:
    repo: str
    revision: str = "main"

    @property
    def uri(self) -> str:
        return f"{HF_SCHEME}{self.repo}@{self.revision}"

    @property
    def pinned(self) -> bool:
        return bool(COMMIT.match(self.revision))


@dataclass(frozen=True)
class S3Source:
    bucket: str
    prefix: str = ""  # without leading or trailing '/'

    @property
    def uri(self) -> str:
        return f"{S3_SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{S3_SCHEME}{self.bucket}"


def is_remote(model: str) -> bool:
    return isinstance(model, str) and model.startswith((HF_SCHEME, S3_SCHEME))


def parse_source(model: str) -> HubSource | S3Source:
    """The source a `model` string names; ValueError naming `model` when it is malformed."""
    if model.startswith(HF_SCHEME):
        rest = model[len(HF_SCHEME):]
        repo, at, revision = rest.partition("@")
        if not HUB_REPO.fullmatch(repo) or any(len(p) > 96 for p in repo.split("/")):
            raise ValueError(f"model={model!r}: expected hf://ORG/NAME[@REVISION] with a Hub "
                             "repository id such as meta-llama/Llama-3.1-8B-Instruct")
        if at and (not HUB_REVISION.fullmatch(revision) or len(revision) > 255):
            raise ValueError(f"model={model!r}: the revision after '@' must be a branch, tag or "
                             "commit ('/'-separated parts of letters, digits, '.', '_', '-'; no "
                             "empty, leading or trailing '/', no part starting or ending with '.')")
        return HubSource(repo, revision if at else "main")
    if model.startswith(S3_SCHEME):
        bucket, _, prefix = model[len(S3_SCHEME):].partition("/")
        if not S3_BUCKET.fullmatch(bucket) or not 3 <= len(bucket) <= 63:
            raise ValueError(f"model={model!r}: expected s3://BUCKET/PREFIX with a bucket name of "
                             "3-63 lowercase letters, digits, '.' and '-' (no '..')")
        prefix = prefix[:-1] if prefix.endswith("/") else prefix
        if not S3_PREFIX.fullmatch(prefix):
            raise ValueError(f"model={model!r}: the prefix must not contain empty, '.' or '..' parts, "
                             "'$', spaces or control characters")
        return S3Source(bucket, prefix)
    raise ValueError(f"model={model!r}: not an hf:// or s3:// source")


@dataclass(frozen=True)
class FileSelection:
    """Which of a source's files to fetch: DEFAULT_FILES at the top level plus `extra`
    patterns (matched against the whole relative path, e.g. `original/*` or `*.bin`)."""
    extra: tuple[str, ...] = field(default_factory=tuple)

    def wants(self, name: str) -> bool:
        if any(fnmatch.fnmatchcase(name, p) for p in self.extra):
            return True
        return "/" not in name and any(fnmatch.fnmatchcase(name, p) for p in DEFAULT_FILES)

    def select(self, names: list[str]) -> list[str]:
        return sorted(n for n in names if self.wants(n))
