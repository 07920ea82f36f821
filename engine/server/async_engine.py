"""Drives the synchronous LLMEngine from one background thread for an asyncio server.

The engine is not thread-safe, so only the engine thread touches it. The event loop hands
it commands (add, abort, live limit changes) through a queue; the engine thread steps while
work is pending and hands each step's outputs back with one `call_soon_threadsafe`, into a
per-request asyncio queue. Many HTTP requests are thus batched continuously by the engine."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from typing import TYPE_CHECKING, Callable

from ..core.executor import EngineDeadError
from ..core.outputs import RequestOutput
from ..core.sampling_params import SamplingParams
from ..metrics.exporter import ServerMetrics
from .streams import RequestStream, RequestTrack, StreamUpdate

if TYPE_CHECKING:
    from ..llm_engine import LLMEngine

log = logging.getLogger("kvpilot.server")

_IDLE_WAIT_S = 0.5  # how long the idle engine thread blocks before re-checking for stop


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        engine.latency_sink = metrics  # called on the engine thread, between steps
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._live: dict[str, RequestTrack] = {}  # engine thread only
        self._streams: dict[str, RequestStream] = {}  # event loop only
        self._pending_adds = 0  # event loop only
        # (waiting in the engine at its last publish, adds it took since): written whole by
        # the engine thread only, so the event loop never reads one half without the other
        # and a request taken after a publish is counted until the next one shows it.
        self._waiting = (0, 0)

    # --- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.metrics.record_stats(self.engine.stats())
        self.metrics.record_capacity(self.engine.kv_cache_bytes, self.engine.kv_bytes_per_token,
                                     self.engine.weight_bytes, self.engine.kv_cache_element_bytes)
        config = self.engine.config
        self.metrics.record_cache_config(  # vLLM's CacheConfig key names
            block_size=config.block_size, cache_dtype=config.kv_cache_dtype, enable_prefix_caching=config.enable_prefix_caching,
            gpu_memory_utilization=config.gpu_memory_utilization, kv_cache_memory_bytes=self.engine.kv_cache_bytes,
            num_gpu_blocks=self.engine.kv_cache.num_blocks, num_cpu_blocks=None,
            kv_cache_size_tokens=self.engine.kv_capacity_tokens)
        # From here on only the engine thread runs the model (see cpu_threads.py).
        self.engine.runner.release_loader_threads()
        self._thread = threading.Thread(target=self._run, name="kvpilot-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort whatever is left, stop the engine thread, then the engine's other ranks."""
        self.abort_all()
        self._commands.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
            if self._thread.is_alive():  # stuck in a step: the ranks go with this process
                log.error("the engine thread did not stop within 30 s; leaving its ranks to exit with the process")
                return
        await asyncio.to_thread(self.engine.shutdown)

    @property
    def failure(self) -> str | None:
        """Why the engine failed for good, or None: a string the executor sets once (a
        rank's watcher thread), so the event loop may read it."""
        return self.engine.failure()

    # --- what the server reads of the engine --------------------------------------------
    # The one door: the tokenizer is fixed at start-up (and thread-safe), and the live
    # limits are plain ints the engine thread swaps whole, so reading them from the event
    # loop needs no command round trip.
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.engine.max_num_seqs

    def live_settings(self) -> dict[str, int]:
        """The live-tunable settings in effect (num_speculative_tokens only where configured)."""
        values = {"max_num_seqs": self.engine.max_num_seqs, "max_model_len": self.engine.max_model_len,
                  "max_num_batched_tokens": self.engine.max_num_batched_tokens}
        if self.engine.num_speculative_tokens is not None:
            values["num_speculative_tokens"] = self.engine.num_speculative_tokens
        return values

    @property
    def num_active(self) -> int:
        """Requests admitted by the server and not yet released by their handler."""
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Queued requests, new and preempted, at the engine's last publish."""
        return self._waiting[0]

    @property
    def queue_length(self) -> int:
        """Waiting sequences in the engine (preempted ones included: they count against the
        cap, so the gauge of new arrivals stays within it), plus adds it took since it last published (a
        step can run for a while between the two: without them, a burst arriving then was
        admitted past the cap), plus adds not yet handed to it. A request the engine took
        may be counted twice for a moment, never zero times."""
        published, since = self._waiting
        return published + since + self._pending_adds

    def _unique_request_id(self, wanted: str | None) -> str:
        """The client's id (x-request-id) when no live request has it, else made unique: the
        server's one resolution of ids; the engine's add_request is their one check."""
        if not wanted:
            return uuid.uuid4().hex
        rid = wanted
        while rid in self._streams:
            rid = f"{wanted}-{uuid.uuid4().hex[:8]}"
        return rid

    # --- loop side -------------------------------------------------------------------
    async def add(self, wanted_id: str | None, prompt_ids: list[int], params: SamplingParams,
                  arrival_time: float | None = None, service_tier: str = "default") -> RequestStream:
        """Queue a request under `wanted_id` (made unique among live requests; None: a fresh
        one); RequestError (from the engine's validation at add_request) if it is refused."""
        request_id = self._unique_request_id(wanted_id)  # no await before the stream is in
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        stream = RequestStream(request_id, self._release, params.n)
        self._streams[request_id] = stream
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._pending_adds += 1
        self._commands.put(lambda: self._do_add(request_id, prompt_ids, params, arrival, service_tier, fut))
        try:
            await asyncio.wrap_future(fut)
        except BaseException:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not fut.cancelled() and (not fut.done() or fut.exception() is None):
                self.abort(request_id)  # cancelled after the engine took it: drop it again
            raise
        finally:
            self._pending_adds -= 1
        return stream

    def abort_all(self) -> None:
        """Abort every admitted request; their streams end with finish_reason "abort"."""
        for rid in list(self._streams):
            self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Thread-safe and non-blocking; the engine drops the request before its next step."""
        self._commands.put(lambda: self._do_abort(request_id))

    def _release(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
        if not stream.finished:
            stream.finished = True
            self.abort(stream.request_id)

    async def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """Run fn(engine) on the engine thread between steps; its result or exception."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn(self.engine))
            except BaseException as exc:  # handed back to the caller
                fut.set_exception(exc)

        self._commands.put(run)
        return await asyncio.wrap_future(fut)

    async def update_limits(self, **limits: int | None) -> None:
        await self.call(lambda engine: engine.update_limits(**limits))

    def _deliver(self, batch: list[StreamUpdate]) -> None:
        for snap in batch:
            stream = self._streams.get(snap.request_id)
            if stream is not None:
                stream._put(snap)

    # --- engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests()
            commands = []
            try:
                commands.append(self._commands.get_nowait() if busy
                                else self._commands.get(timeout=_IDLE_WAIT_S))
                while True:  # everything queued runs before the next step
                    commands.append(self._commands.get_nowait())
            except queue.Empty:
                pass
            for cmd in commands:
                self._execute(cmd)
            if None in commands:
                return  # stop(): its aborts were queued ahead of the sentinel
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as exc:  # outside any one request (step_isolation): fail all, keep serving
                    log.exception("engine step failed")
                    self._fail_all(str(exc) if isinstance(exc, EngineDeadError)
                                   else f"engine step failed: {type(exc).__name__}")
                    outputs = []
                if outputs:
                    self._dispatch(outputs)
            self._publish()

    def _execute(self, cmd: Callable[[], None] | None) -> None:
        if cmd is None:
            return
        try:
            cmd()
        except Exception:
            log.exception("engine command failed")

    def _publish(self) -> None:
        stats = self.engine.stats()
        self._waiting = (stats.num_queued, 0)
        self.metrics.record_stats(stats)

    def _post(self, batch: list[StreamUpdate]) -> None:
        if batch and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, batch)

    def _do_add(self, rid: str, prompt_ids: list[int], params: SamplingParams, arrival: float,
                service_tier: str, fut: concurrent.futures.Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return  # the caller went away before the engine got to it
        try:
            self.engine.add_request(rid, prompt_ids, params, arrival_time=arrival, service_tier=service_tier)
        except Exception as exc:
            fut.set_exception(exc)
            return
        self._live[rid] = RequestTrack(len(prompt_ids), params.n, params.logprobs is not None)
        published, since = self._waiting
        self._waiting = (published, since + params.n)
        fut.set_result(None)

    def _do_abort(self, rid: str) -> None:
        track = self._live.pop(rid, None)
        if track is None:
            return
        self.engine.abort_request(rid)
        self._post([StreamUpdate(rid, track.aborted(), True, track.num_prompt_tokens,
                             track.num_cached_tokens)])

    def _fail_all(self, message: str) -> None:
        batch = []
        for rid in list(self._live):
            track = self._live.pop(rid)
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("abort after a failed step also failed")
            batch.append(StreamUpdate(rid, [], True, track.num_prompt_tokens, error=message))
        self._post(batch)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        batch = []
        for out in outputs:
            track = self._live.get(out.request_id)
            if track is None:
                continue  # aborted while this step ran
            if out.error is not None:  # the engine failed on this request alone
                del self._live[out.request_id]
                batch.append(StreamUpdate(out.request_id, [], True, track.num_prompt_tokens, error=out.error))
                continue
            m = out.metrics
            track.num_cached_tokens = m.num_cached_tokens if m else 0
            batch.append(StreamUpdate(out.request_id, track.deltas(out.outputs), out.finished,
                                  track.num_prompt_tokens, track.num_cached_tokens,
                                  metrics=m if out.finished else None))
            if out.finished:
                del self._live[out.request_id]
        self._post(batch)
