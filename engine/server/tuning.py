"""The live tuning file: a JSON object the operator writes (through a ConfigMap mount)
holding limits the engine can change while serving.

    {"max_num_seqs": 24, "max_model_len": 1024, "num_speculative_tokens": 2,
     "max_num_batched_tokens": 2048}

max_num_batched_tokens (the chunked-prefill budget) moves within [max_num_seqs, the value the
engine started with].
The server polls it; a Kubernetes ConfigMap update swaps a symlink, which can leave the
mtime unchanged, so the content is what is compared. A changed file is validated and
applied between engine steps, without dropping requests; an invalid one is logged and the
values in effect stay. Unknown keys are logged and ignored (room for more settings), as is
num_speculative_tokens on an engine started without speculation (0 turns it off)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from ..config.validation import positive_int

log = logging.getLogger("kvpilot.server.tuning")

LIVE_SETTINGS = ("max_num_seqs", "max_model_len", "num_speculative_tokens", "max_num_batched_tokens")
ZERO_ALLOWED = ("num_speculative_tokens",)  # 0 is a setting (off), not a missing value
POLL_INTERVAL_S = 0.5


class TuningError(ValueError):
    pass


def parse_tuning(raw: bytes) -> dict[str, int]:
    """The live settings a file asks for; TuningError (naming the field) if invalid."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TuningError(f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise TuningError(f"expected a JSON object, got {type(data).__name__}")
    wanted: dict[str, int] = {}
    for key in LIVE_SETTINGS:
        value = data.get(key)
        if value is None:
            continue
        try:
            if key in ZERO_ALLOWED:
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"{key} must be an integer >= 0, got {value!r}")
                wanted[key] = value
            else:
                wanted[key] = positive_int(key, value)
        except ValueError as exc:
            raise TuningError(str(exc)) from None
    unknown = sorted(set(data) - set(LIVE_SETTINGS))
    if unknown:
        log.info("tuning file: ignoring settings this engine cannot change live: %s", ", ".join(unknown))
    return wanted


class TuningWatcher:
    """Polls one file and applies its changes through `apply(**limits)` (async) and
    `current()` -> dict of the values in effect."""

    def __init__(self, path: str | Path, apply, current) -> None:
        self.path = Path(path)
        self._apply = apply
        self._current = current
        self._last: bytes | None = None
        self._missing_logged = False

    def _read(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            if not self._missing_logged:
                log.warning("tuning file %s does not exist (yet); keeping current limits", self.path)
                self._missing_logged = True
            return None
        except OSError as exc:
            log.warning("tuning file %s unreadable: %s; keeping current limits", self.path, exc)
            return None

    async def check(self) -> bool:
        """Read the file once; apply it if its content changed. True when limits changed."""
        raw = self._read()
        if raw is None or raw == self._last:
            return False
        self._last = raw
        self._missing_logged = False
        current = self._current()
        try:
            wanted = parse_tuning(raw)
        except TuningError as exc:
            log.warning("tuning file %s rejected (%s); keeping %s", self.path, exc, _fmt(current))
            return False
        unsupported = sorted(k for k in wanted if k not in current)
        if unsupported:  # e.g. num_speculative_tokens where the engine does not speculate
            log.info("tuning file: ignoring settings this engine was not started with: %s", ", ".join(unsupported))
        changes = {k: v for k, v in wanted.items() if k in current and current.get(k) != v}
        if not changes:
            return False
        try:
            await self._apply(**changes)
        except ValueError as exc:
            log.warning("tuning file %s rejected (%s); keeping %s", self.path, exc, _fmt(current))
            return False
        log.info("tuning file %s applied: %s", self.path, ", ".join(
            f"{k} {current.get(k)} -> {v}" for k, v in changes.items()))
        return True

    async def run(self, interval: float = POLL_INTERVAL_S) -> None:
        while True:
            try:
                await self.check()
            except Exception:
                log.exception("tuning file check failed")
            await asyncio.sleep(interval)


def _fmt(values: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())
