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

# Hub repository ids: ORG/NAME, each part letters, digits, '-', '_', '.' (no '--' or '..',
# which the Hub refuses too); a revision is a branch, tag or commit (no spaces or '..').
_HUB_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
HUB_REPO = re.compile(rf"^{_HUB_PART}/{_HUB_PART}$")
HUB_REVISION = re.compile(r"^[A-Za-z0-9._/-]{1,255}$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
# S3 bucket names (the AWS rules, which MinIO, Ceph and R2 follow): 3-63 characters.
S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")

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
        if not HUB_REPO.match(repo) or "--" in repo or ".." in repo:
            raise ValueError(f"model={model!r}: expected hf://ORG/NAME[@REVISION] with a Hub "
                             "repository id such as meta-llama/Llama-3.1-8B-Instruct")
        if at and (not HUB_REVISION.match(revision) or ".." in revision):
            raise ValueError(f"model={model!r}: the revision after '@' must be a branch, tag or "
                             "commit (letters, digits, '.', '_', '-', '/')")
        return HubSource(repo, revision if at else "main")
    if model.startswith(S3_SCHEME):
        bucket, _, prefix = model[len(S3_SCHEME):].partition("/")
        if not S3_BUCKET.match(bucket):
            raise ValueError(f"model={model!r}: expected s3://BUCKET/PREFIX with a bucket name of "
                             "3-63 lowercase letters, digits, '.' and '-'")
        prefix = prefix.rstrip("/")
        if prefix.startswith("/") or "//" in prefix or any(p in (".", "..") for p in prefix.split("/")):
            raise ValueError(f"model={model!r}: the prefix must not contain empty, '.' or '..' parts")
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
