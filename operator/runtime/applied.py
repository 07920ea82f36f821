"""What this operator process last wrote to each owned object, so that a pass whose
desired object is the one it already applied sends nothing.

At steady state a reconcile's server-side applies change nothing, yet each is a full
PATCH the API server must decode, merge with the managed fields and compare (and the
one-replica PodDisruptionBudget delete is a 404 every time): most of a pass's requests
and most of the API server's work for a fleet. The cache skips such a request when:

- the object's manifest is byte-for-byte the one last applied (a digest of its JSON), and
- for an object the pass has just read (the Deployment), its resourceVersion is still the
  one the apply returned: nobody changed it since, so skipping is exact;
- for an object the pass does not read (the tuning ConfigMap, the Service, the PDB), the
  last apply is under RECHECK_S old: a hand edit or deletion of one of those is undone
  within that time rather than at the next pass.

Every entry is older than RECHECK_S at most once before it is applied again, so entries of
deleted deployments are dropped within 2 x RECHECK_S. One cache per process (the leader);
a new leader starts empty and applies everything once.
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass
from typing import Callable

RECHECK_S = 60.0

Key = tuple[str, str, str, str]  # apiVersion, kind, namespace, name


def key_of(manifest: dict) -> Key:
    meta = manifest["metadata"]
    return manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"]


def digest_of(manifest: dict) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class Entry:
    digest: str | None       # None: this process deleted the object (or found it absent)
    resource_version: str | None
    written_at: float
    result: dict | None      # what the API server answered to the apply


class AppliedCache:
    """Thread-safe (the resync workers share it)."""

    def __init__(self, recheck_s: float = RECHECK_S, clock: Callable[[], float] = time.monotonic):
        if not recheck_s > 0:
            raise ValueError(f"recheck_s must be positive, got {recheck_s!r}")
        self.recheck_s, self.clock = recheck_s, clock
        self._entries: dict[Key, Entry] = {}
        self._lock = threading.Lock()
        self._pruned_at = clock()

    def _current(self, key: Key) -> Entry | None:
        with self._lock:
            entry = self._entries.get(key)
        if entry is None or self.clock() - entry.written_at >= self.recheck_s:
            return None
        return entry

    def applied(self, manifest: dict, live: dict | None = None, *, live_read: bool = False) -> dict | None:
        """The apply's earlier answer when `manifest` needs no request now, else None. With
        `live_read`, `live` is the object as just read (None: it does not exist)."""
        entry = self._current(key_of(manifest))
        if entry is None or entry.digest != digest_of(manifest):
            return None
        if live_read:
            if live is None or (live.get("metadata") or {}).get("resourceVersion") != entry.resource_version:
                return None
            return live
        return entry.result

    def deleted(self, key: Key) -> bool:
        """Whether this process deleted `key` (or found it absent) under RECHECK_S ago."""
        entry = self._current(key)
        return entry is not None and entry.digest is None

    def remember_apply(self, manifest: dict, result: dict) -> None:
        rv = (result.get("metadata") or {}).get("resourceVersion")
        self._put(key_of(manifest), Entry(digest_of(manifest), rv, self.clock(), result))

    def remember_delete(self, key: Key) -> None:
        self._put(key, Entry(None, None, self.clock(), None))

    def forget(self, key: Key) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def _put(self, key: Key, entry: Entry) -> None:
        with self._lock:
            self._entries[key] = entry
            if entry.written_at - self._pruned_at >= self.recheck_s:
                self._pruned_at = entry.written_at
                stale = [k for k, e in self._entries.items() if entry.written_at - e.written_at >= self.recheck_s]
                for k in stale:
                    del self._entries[k]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
