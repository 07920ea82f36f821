"""What the model fetchers share: a remote file, a listing, progress, and the one error type
whose `reason` the operator turns into a condition (so no traceback is ever the message)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

# Reasons, as the operator shows them (ModelReady=False / Degraded reason "Model" + reason).
UNAUTHORIZED = "Unauthorized"
REPOSITORY_NOT_FOUND = "RepositoryNotFound"
REVISION_NOT_FOUND = "RevisionNotFound"
BUCKET_NOT_FOUND = "BucketNotFound"
FILES_MISSING = "FilesMissing"
NO_SPACE = "NoSpace"
UNREACHABLE = "Unreachable"
CHECKSUM_MISMATCH = "ChecksumMismatch"
SOURCE_CHANGED = "SourceChanged"
NOT_CACHED = "NotCached"
INVALID_SOURCE = "InvalidSource"
CACHE_ERROR = "CacheError"  # the cache cannot be written (permissions, a read-only volume)
# Worth retrying as they are: the kubelet's backoff restarts the init container.
TRANSIENT = (UNREACHABLE, SOURCE_CHANGED)


class ModelFetchError(ValueError):
    """A model that cannot be fetched, with the cause in one line (a ValueError, so the CLI
    prints it as `kvpilot fetch-model: error: ...` and exits 2)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class RemoteFile:
    name: str  # relative to the model's root, '/'-separated
    size: int | None
    sha256: str | None = None  # LFS files on the Hub
    git_sha1: str | None = None  # small files on the Hub: the git blob id
    md5: str | None = None  # S3 single-part uploads: the ETag
    etag: str | None = None  # S3: the listing's ETag (downloads are conditional on it)


@dataclass(frozen=True)
class Listing:
    """A snapshot of a source: its identity in the cache (a commit, or a digest of an S3
    listing) and the files to fetch."""
    key: str
    files: tuple[RemoteFile, ...]
    refs: tuple[str, ...] = ()  # names to point at key (a branch or tag; "latest")

    @property
    def total_bytes(self) -> int:
        return sum(f.size or 0 for f in self.files)


@dataclass
class Progress:
    phase: str  # Resolving | Waiting | Downloading | Verifying | Ready
    source: str
    revision: str | None = None
    done: int = 0
    total: int = 0
    bytes_per_second: float = 0.0
    files: int = 0
    downloaded: int = 0  # fetched by this process (a resumed or shared download fetches less)
    path: str | None = None

    @property
    def percent(self) -> float:
        return 100.0 * self.done / self.total if self.total else (100.0 if self.phase == "Ready" else 0.0)

    def line(self) -> str:
        """One human line: `hf://org/name@0123abcd4567: Downloading 37.0% (12.0 MiB of 32.4 MiB) at 1.0 MiB/s`."""
        where = self.source + (f"@{self.revision[:12]}" if self.revision and self.source.startswith("hf://") else "")
        if self.phase in ("Downloading", "Waiting", "Verifying"):
            note = " (another process is downloading it)" if self.phase == "Waiting" else ""
            return (f"{where}: {self.phase} {self.percent:.1f}% ({human_size(self.done)} of {human_size(self.total)}) "
                    f"at {human_size(self.bytes_per_second)}/s{note}")
        return f"{where}: {self.phase}" + (f" ({self.path})" if self.path else "")

    def dump(self) -> dict:
        out = {"phase": self.phase, "source": self.source, "revision": self.revision,
               "done": self.done, "total": self.total, "percent": round(self.percent, 1),
               "bytesPerSecond": round(self.bytes_per_second), "files": self.files,
               "downloaded": self.downloaded}
        if self.path is not None:
            out["path"] = self.path
        return out


def human_size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass
class FetchResult:
    path: Path
    revision: str
    files: int
    total_bytes: int
    downloaded: int
    notes: list[str] = field(default_factory=list)


def file_digests(path: Path, want: RemoteFile) -> list[tuple[str, str, str]]:
    """(kind, expected, actual) for each checksum the source gave for this file."""
    checks = []
    if want.sha256:
        checks.append(("sha256", want.sha256, hashlib.sha256()))
    if want.md5:
        checks.append(("md5", want.md5, hashlib.md5(usedforsecurity=False)))
    if want.git_sha1:  # git hashes "blob <size>\0" + content
        h = hashlib.sha1(usedforsecurity=False)
        h.update(f"blob {path.stat().st_size}\0".encode())
        checks.append(("git-sha1", want.git_sha1, h))
    if not checks:
        return []
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            for _, _, h in checks:
                h.update(chunk)
    return [(kind, expected, h.hexdigest()) for kind, expected, h in checks]
