"""One request's stream from the engine thread to its HTTP handler: each step hands it
only what its choices gained (deltas, sliced once on the engine thread); the loop side
merges deltas a lagging reader has not taken yet and grows the whole choices in place."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

from ..core.outputs import CompletionOutput, RequestMetrics, TokenLogprob


class EngineError(RuntimeError):
    """The engine failed while stepping; the request cannot complete."""


class StreamClosed(Exception):
    """The stream was closed (client gone, or released) before the request finished."""


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice gained in one step (or several, merged when the reader lags):
    new text, new token ids, their logprobs; the finish reason once it ends."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None  # None when the request asked for none
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def merge(self, later: "ChoiceDelta") -> None:
        self.text += later.text
        self.token_ids += later.token_ids
        if self.logprobs is not None and later.logprobs is not None:
            self.logprobs += later.logprobs
        self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason


class Choice:
    """One choice as the loop side has received it so far, grown by deltas in place
    (O(new) per step; the text is joined once, when read)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self._text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        if len(self._text) > 1:
            self._text = ["".join(self._text)]
        return self._text[0] if self._text else ""

    def apply(self, d: ChoiceDelta) -> None:
        if d.text:
            self._text.append(d.text)
        self.token_ids += d.token_ids
        if d.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += d.logprobs
        self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason


@dataclass
class StreamUpdate:
    """One request's update: the deltas the engine sent (merged, if several were queued)
    and, on the loop side, every choice so far (`choices`, filled in by the stream)."""

    request_id: str
    deltas: list[ChoiceDelta]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: RequestMetrics | None = None  # the engine's timestamps, with the final snapshot
    choices: list[Choice] = field(default_factory=list)

    def merge(self, later: "StreamUpdate") -> None:
        mine = {d.index: d for d in self.deltas}
        for d in later.deltas:
            if d.index in mine:
                mine[d.index].merge(d)
            else:
                self.deltas.append(d)
        self.finished, self.error, self.metrics = later.finished, later.error, later.metrics
        self.num_cached_tokens = later.num_cached_tokens


@dataclass
class RequestTrack:
    """Engine-thread bookkeeping per request: how much of each choice has been sent
    (the engine itself records its latencies)."""

    num_prompt_tokens: int
    n: int
    logprobs: bool
    num_cached_tokens: int = 0
    sent_text: list[int] = field(init=False)  # per choice: characters sent
    sent_tokens: list[int] = field(init=False)  # per choice: tokens sent
    done: list[bool] = field(init=False)  # per choice: its finish was sent

    def __post_init__(self) -> None:
        self.sent_text, self.sent_tokens, self.done = [0] * self.n, [0] * self.n, [False] * self.n

    def deltas(self, outputs: list[CompletionOutput]) -> list[ChoiceDelta]:
        """What each choice gained since the last call: O(new) slices of the engine's output."""
        out = []
        for c in outputs:
            i = c.index
            if self.done[i]:
                continue
            t, k = self.sent_text[i], self.sent_tokens[i]
            if len(c.token_ids) == k and len(c.text) == t and c.finish_reason is None:
                continue
            out.append(ChoiceDelta(i, c.text[t:], c.token_ids[k:],
                                   c.logprobs[k:] if c.logprobs is not None else None,
                                   c.finish_reason, c.stop_reason))
            self.sent_text[i], self.sent_tokens[i] = len(c.text), len(c.token_ids)
            self.done[i] = c.finish_reason is not None
        return out

    def aborted(self) -> list[ChoiceDelta]:
        return [ChoiceDelta(i, "", [], [] if self.logprobs else None, "abort")
                for i in range(self.n) if not self.done[i]]


class RequestStream:
    """The loop-side end of one request: its updates in order (queued ones merged when
    the reader lags), and every choice so far."""

    def __init__(self, request_id: str, release: Callable[["RequestStream"], None], n: int = 1) -> None:
        self.request_id = request_id
        self._release = release  # the engine's: forget the stream, abort unless finished
        self._queue: asyncio.Queue[StreamUpdate | None] = asyncio.Queue()
        self.choices = [Choice(i) for i in range(n)]
        self.finished = False
        self.closed = False

    def _put(self, snap: StreamUpdate | None) -> None:
        self._queue.put_nowait(snap)

    async def get(self) -> StreamUpdate:
        snap = await self._queue.get()
        while snap is not None and not snap.finished and not self._queue.empty():
            later = self._queue.get_nowait()
            if later is None:
                snap = None
                break
            snap.merge(later)
        if snap is None:
            raise StreamClosed(self.request_id)
        if snap.error is not None:
            self.finished = True
            raise EngineError(snap.error)
        for d in snap.deltas:
            self.choices[d.index].apply(d)
        snap.choices = self.choices
        self.finished = snap.finished
        return snap

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamUpdate:
        if self.closed:
            raise StreamClosed(self.request_id)
        if self.finished:
            raise StopAsyncIteration
        return await self.get()

    def close(self) -> None:
        """Abort in the engine unless finished, and wake a reader with StreamClosed.
        Idempotent; handlers call it from `finally`, the disconnect watcher on disconnect."""
        if self.closed:
            return
        self.closed = True
        self._release(self)
        self._queue.put_nowait(None)
