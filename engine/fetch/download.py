"""Fetch an `hf://` or `s3://` model into the cache: list, lock, download (resuming what a
crash left), verify sizes and checksums, then rename the snapshot into place in one step.
Progress (bytes on disk against the listing's total) goes to a callback every interval,
including while another process holds the lock and downloads the same snapshot."""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .hub import hub_download, hub_listing
from .s3 import S3Options, s3_download, s3_listing
from .base import (CACHE_ERROR, CHECKSUM_MISMATCH, FILES_MISSING, NO_SPACE, NOT_CACHED, FetchResult, Listing,
                          ModelFetchError, Progress, file_digests, human_size)
from .cache import MANIFEST, SnapshotDirs, bytes_on_disk, exclusive, source_dirs
from .uri import REQUIRED_FILE, FileSelection, HubSource, S3Source, parse_source

ProgressFn = Callable[[Progress], None]


@dataclass(frozen=True)
class FetchOptions:
    models_dir: Path
    selection: FileSelection = field(default_factory=FileSelection)
    hub_endpoint: str | None = None
    hub_token: str | None = None
    s3: S3Options = field(default_factory=S3Options)
    progress: ProgressFn | None = None
    interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0.05 <= self.interval_s <= 3600:
            raise ValueError(f"interval={self.interval_s}: seconds between progress reports, 0.05 to 3600")

    @classmethod
    def from_env(cls, models_dir: Path, **kw) -> "FetchOptions":
        """Credentials and endpoints from the variables huggingface_hub and boto3 read."""
        return cls(models_dir=models_dir, hub_endpoint=os.environ.get("HF_ENDPOINT") or None,
                   hub_token=os.environ.get("HF_TOKEN") or None, s3=S3Options.from_env(), **kw)


def cached_snapshot(model: str, models_dir: Path) -> Path | None:
    """A finished snapshot for `model` without touching the network: a pinned commit, or the
    commit (S3: the listing) the revision last resolved to on this cache."""
    source = parse_source(model)
    dirs = source_dirs(models_dir, source)
    if isinstance(source, HubSource):
        key = source.revision if source.pinned else dirs.read_ref(source.revision)
    else:
        key = dirs.read_ref("latest")
    if key is None:
        return None
    snap = dirs.snapshot(key)
    return snap if (snap / REQUIRED_FILE).is_file() else None


def require_cached(model: str, models_dir: Path) -> Path:
    snap = cached_snapshot(model, models_dir)
    if snap is None:
        raise ModelFetchError(NOT_CACHED, f"model={model!r} is not in the cache {models_dir} (offline: run "
                                          "`kvpilot fetch-model` first, or unset KVPILOT_MODEL_OFFLINE)")
    return snap


class _Meter:
    """Reports bytes on disk under a folder every interval from a thread of its own."""

    def __init__(self, progress: Progress, folder: Path, fn: ProgressFn | None, interval_s: float):
        self.progress, self.folder, self.fn, self.interval_s = progress, folder, fn, interval_s
        self.start_done = min(bytes_on_disk(folder), progress.total) if folder.exists() else 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpilot-fetch-progress", daemon=True)
        self._last = (time.monotonic(), self.start_done)

    def sample(self) -> None:
        done = min(bytes_on_disk(self.folder), self.progress.total) if self.folder.exists() else 0
        now = time.monotonic()
        t0, d0 = self._last
        if now > t0:
            rate = max(done - d0, 0) / (now - t0)
            # smoothed, so one slow second does not swing the rate shown in status
            self.progress.bytes_per_second = rate if not self.progress.bytes_per_second \
                else 0.5 * self.progress.bytes_per_second + 0.5 * rate
        self._last = (now, done)
        self.progress.done = done
        self.progress.downloaded = max(done - self.start_done, 0)
        if self.fn is not None:
            self.fn(self.progress)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> "_Meter":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        # The last figure, once no sample of the thread's can finish after it: a sample that
        # walked the folder while a file was renamed into place counts that file short.
        self.sample()


def fetch(model: str, options: FetchOptions) -> FetchResult:
    """The model's local snapshot, downloaded if needed. ModelFetchError names the cause."""
    source = parse_source(model)
    report = options.progress or (lambda p: None)
    report(Progress("Resolving", source.uri))
    listing = _listing(source, options)
    if not any(f.name == REQUIRED_FILE for f in listing.files):
        names = ", ".join(f.name for f in listing.files[:5]) or "nothing"
        raise ModelFetchError(FILES_MISSING, f"{source.uri}: no {REQUIRED_FILE} (found: {names})")
    dirs = source_dirs(options.models_dir, source)
    progress = Progress("Downloading", source.uri, listing.key, total=listing.total_bytes,
                        files=len(listing.files))
    snap = dirs.snapshot(listing.key)
    if not (snap / REQUIRED_FILE).is_file():
        partial = dirs.partial(listing.key)

        def waiting() -> None:  # another process downloads this snapshot: show its progress
            progress.phase = "Waiting"
            done = bytes_on_disk(partial) if partial.exists() else 0
            progress.done = min(done, progress.total)
            report(progress)

        try:
            with exclusive(dirs.lock_file(listing.key), on_wait=waiting, poll_s=options.interval_s):
                if not (snap / REQUIRED_FILE).is_file():
                    progress.phase = "Downloading"
                    _download(source, listing, dirs, options, progress, report)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ModelFetchError(NO_SPACE, f"{source.uri}: no space left in {options.models_dir} "
                                                f"({human_size(listing.total_bytes)} needed)") from None
            # e.g. a cache volume the pod's user cannot write: one line, not a traceback
            raise ModelFetchError(CACHE_ERROR, f"{source.uri}: the cache {options.models_dir}: "
                                               f"{e.strerror or e} ({e.filename or ''})") from None
    for ref in listing.refs:
        dirs.write_ref(ref, listing.key)
    progress.phase, progress.done, progress.path = "Ready", listing.total_bytes, str(snap)
    report(progress)
    return FetchResult(snap, listing.key, len(listing.files), listing.total_bytes, progress.downloaded)


def _listing(source: HubSource | S3Source, options: FetchOptions) -> Listing:
    if isinstance(source, HubSource):
        return hub_listing(source, options.selection, options.hub_endpoint, options.hub_token)
    return s3_listing(source, options.selection, options.s3)


def _download(source, listing: Listing, dirs: SnapshotDirs, options: FetchOptions,
              progress: Progress, report: ProgressFn) -> None:
    partial = dirs.partial(listing.key)
    partial.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(partial).free
    missing = listing.total_bytes - min(bytes_on_disk(partial), listing.total_bytes)
    if missing > free:
        raise ModelFetchError(NO_SPACE, f"{source.uri}: {human_size(missing)} still to download but only "
                                        f"{human_size(free)} free in {options.models_dir}")
    with _Meter(progress, partial, report, options.interval_s):
        for f in listing.files:
            if isinstance(source, HubSource):
                hub_download(source, listing, f, partial, options.hub_endpoint, options.hub_token)
            else:
                s3_download(source, f, partial, options.s3)
    progress.phase = "Verifying"
    report(progress)
    _verify(source, listing, partial)
    shutil.rmtree(partial / ".cache", ignore_errors=True)  # huggingface_hub's download metadata
    (partial / MANIFEST).write_text("".join(f"{f.name}\t{f.size}\n" for f in listing.files))
    snap = dirs.snapshot(listing.key)
    snap.parent.mkdir(parents=True, exist_ok=True)
    os.rename(partial, snap)  # one step: a snapshot folder is always whole


def _verify(source, listing: Listing, partial: Path) -> None:
    for f in listing.files:
        path = partial / f.name
        size = path.stat().st_size if path.is_file() else None
        if size is None or (f.size is not None and size != f.size):
            path.unlink(missing_ok=True)  # the next attempt fetches it again
            raise ModelFetchError(CHECKSUM_MISMATCH, f"{source.uri}: {f.name} is {size} bytes, the source "
                                                     f"says {f.size}")
        for kind, expected, actual in file_digests(path, f):
            if expected.lower() != actual:
                path.unlink(missing_ok=True)
                raise ModelFetchError(CHECKSUM_MISMATCH, f"{source.uri}: {f.name} has {kind} {actual}, "
                                                         f"the source says {expected}")
