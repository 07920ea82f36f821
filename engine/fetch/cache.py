"""Where fetched models live, and the rules that make the cache safe to share.

Layout under $KVPILOT_CACHE_DIR/models (the same on a laptop and in a pod, so a user can
run a deployment's exact model locally):

    hf/ORG--NAME/snapshots/COMMIT/      a finished download (renamed in whole, so present
    hf/ORG--NAME/partial/COMMIT/        means complete); a download in progress, resumed
    hf/ORG--NAME/refs/REVISION          after a crash; the commit a branch or tag last
    hf/ORG--NAME/locks/COMMIT.lock      resolved to; held while one process downloads
    s3/BUCKET/PREFIX/snapshots/ID/      ID: a digest of the listing (keys, sizes, ETags)
    s3/BUCKET/PREFIX/refs/latest        the ID last fetched

The lock is an flock(2) on a file in the cache, so two pods sharing a PVC (or two
processes on one machine) never download the same snapshot at once: the second waits,
then finds it finished."""

from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from .uri import HubSource, S3Source

MANIFEST = ".kvpilot-files.json"  # inside a snapshot: the files and sizes it was verified with


@dataclass(frozen=True)
class SnapshotDirs:
    root: Path  # the source's folder in the cache

    def snapshot(self, key: str) -> Path:
        return self.root / "snapshots" / key

    def partial(self, key: str) -> Path:
        return self.root / "partial" / key

    def lock_file(self, key: str) -> Path:
        return self.root / "locks" / f"{key}.lock"

    def ref(self, name: str) -> Path:
        return self.root / "refs" / name

    def read_ref(self, name: str) -> str | None:
        try:
            return self.ref(name).read_text().strip() or None
        except OSError:
            return None

    def write_ref(self, name: str, key: str) -> None:
        path = self.ref(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name.replace('/', '_')}.{os.getpid()}.tmp")
        tmp.write_text(key + "\n")
        os.replace(tmp, path)


def source_dirs(models_dir: Path, source: HubSource | S3Source) -> SnapshotDirs:
    if isinstance(source, HubSource):
        org, name = source.repo.split("/")
        return SnapshotDirs(models_dir / "hf" / f"{org}--{name}")
    return SnapshotDirs(models_dir / "s3" / source.bucket / (source.prefix or "_root"))


@contextmanager
def exclusive(lock_path: Path, on_wait: Callable[[], None] | None = None,
              poll_s: float = 1.0) -> Iterator[None]:
    """Hold an flock on lock_path; while another process holds it, call on_wait each poll."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if on_wait is not None:
                    on_wait()
                time.sleep(poll_s)  # another process downloads; its progress is on_wait's to show
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def is_whole(dest: Path, size: int | None) -> bool:
    """A downloaded file is whole once at its name (it gets there only by writing_whole)."""
    return dest.is_file() and (size is None or dest.stat().st_size == size)


@contextmanager
def writing_whole(dest: Path, size: int | None) -> Iterator[tuple[BinaryIO, int]]:
    """(file, bytes already there): DEST.incomplete opened to append where a crash left it
    (from 0 when it holds more than `size`), renamed to dest when the block ends."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".incomplete")
    have = tmp.stat().st_size if tmp.exists() else 0
    if size is not None and have > size:
        have = 0
    with open(tmp, "ab" if have else "wb") as out:
        yield out, have
    os.replace(tmp, dest)


def bytes_on_disk(folder: Path) -> int:
    """Every regular file's size under folder (finished files and partial ones alike)."""
    total = 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass  # renamed away while we looked
    return total
