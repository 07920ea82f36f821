"""The synchronous engine: add requests, step (schedule, run, update), read outputs."""

from __future__ import annotations

import hashlib
import logging
from array import array

from .core.clock import RealClock
from .config.engine import EngineConfig
from .executor_loading import load_executor
from .core.kv_cache_manager import KVCacheManager
from .core.latency import LatencySink, finished_record
from .metrics.buckets import SERVICE_TIERS
from .core.output_processor import OutputProcessor
from .core.outputs import EngineStats, RequestOutput
from .config.quantity import format_bytes
from .core.request import Request, RequestGroup, RequestStatus, RequestTimes, SampleState
from .core.sampling_params import SamplingParams
from .core.scheduler import Scheduler, SchedulerLimits
from .spec_decode.speculator import check_num_speculative_tokens, make_speculator
from .core.step_isolation import run_isolating, without
from .config.validation import LengthError, RequestError, positive_int, token_ids

log = logging.getLogger("kvpilot.engine")


def _prompt_seed(prompt_ids: list[int], engine_seed: int) -> int:
    """A seed for an unseeded request, fixed by its prompt (the simulator's tokens)."""
    digest = hashlib.blake2b(array("q", prompt_ids).tobytes(), digest_size=8,
                             key=(engine_seed & (2**64 - 1)).to_bytes(8, "little")).digest()
    return int.from_bytes(digest, "little") >> 1


class LLMEngine:
    def __init__(self, config: EngineConfig, clock=None) -> None:
        self.config = config
        self.clock = clock or RealClock()
        self.runner, self.tokenizer = load_executor(config, self.clock)
        self.max_position_embeddings = self.runner.max_position_embeddings
        max_model_len = config.max_model_len or self.max_position_embeddings
        num_blocks = max(self.runner.kv_cache_budget() // self.runner.kv_bytes_per_block, 0)
        self.kv_capacity_tokens = num_blocks * config.block_size
        self._check_max_model_len(max_model_len)
        self.runner.allocate_kv_cache(num_blocks)
        log.info(
            "KV cache: %d blocks of %d tokens (%s, %d tokens); %s",
            num_blocks, config.block_size, format_bytes(num_blocks * self.runner.kv_bytes_per_block),
            self.kv_capacity_tokens, self.runner.describe(),
        )
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerLimits(config.max_num_seqs, config.max_num_batched_tokens, max_model_len),
            self.kv_cache, self.clock,
        )
        self.speculator = make_speculator(config, self.runner, self.kv_cache)
        self.outputs = OutputProcessor(self.tokenizer)
        self.latency_sink: LatencySink | None = None  # TTFT, gaps and finishes, as they happen
        self._left_work = False  # the last step ended with requests still unfinished
        self.prompt_tokens_total = 0
        self.prompt_tokens_cached_total = 0  # of those, supplied by the prefix cache
        self.generation_tokens_total = 0

    def _check_max_model_len(self, max_model_len: int) -> None:
        """max_model_len within the model's positions, and one such sequence in the cache."""
        if max_model_len > self.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({max_model_len}) exceeds the model's max_position_embeddings "
                f"({self.max_position_embeddings})"
            )
        if self.kv_capacity_tokens < max_model_len:
            raise ValueError(
                f"the KV cache holds {self.kv_capacity_tokens} tokens but max_model_len is "
                f"{max_model_len}: one full-length sequence would not fit. Lower max_model_len "
                f"to at most {self.kv_capacity_tokens} or give the cache more memory "
                f"(kv_cache_memory / gpu_memory_utilization)."
            )

    def failure(self) -> str | None:
        """Why the engine cannot run any more (a tensor/pipeline-parallel rank died), or None."""
        return self.runner.failure()

    def shutdown(self) -> None:
        """Stop what the engine started outside this process (other ranks); idempotent."""
        self.runner.shutdown()

    @property
    def kv_bytes_per_token(self) -> int:
        return self.runner.kv_bytes_per_block // self.config.block_size

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_capacity_tokens * self.kv_bytes_per_token

    @property
    def weight_bytes(self) -> int:
        return self.runner.weight_bytes

    @property
    def kv_cache_element_bytes(self) -> int:
        return self.runner.kv_cache_element_bytes

    # --- limits that can change while serving ----------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.scheduler.limits.max_model_len

    @property
    def max_model_len_ceiling(self) -> int:
        """The largest max_model_len a live change can set (the model's positions, the cache)."""
        return min(self.max_position_embeddings, self.kv_capacity_tokens)

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.limits.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        """The chunk budget in effect (live; at most the configured one)."""
        return self.scheduler.limits.max_num_batched_tokens

    @property
    def num_speculative_tokens(self) -> int | None:
        """Drafts per step in effect (0: off), or None when speculation is not configured."""
        return None if self.speculator is None else self.speculator.num_speculative_tokens

    def update_limits(self, *, max_num_seqs: int | None = None, max_model_len: int | None = None,
                      num_speculative_tokens: int | None = None,
                      max_num_batched_tokens: int | None = None) -> None:
        """Apply live-tunable limits; ValueError (naming the field) leaves all unchanged.
        max_num_batched_tokens (the chunk budget) may move within [max_num_seqs, the value
        the engine started with]: activation memory was profiled for that one."""
        if max_num_seqs is not None:
            positive_int("max_num_seqs", max_num_seqs)
        if max_num_batched_tokens is not None:
            positive_int("max_num_batched_tokens", max_num_batched_tokens)
            if max_num_batched_tokens > self.config.max_num_batched_tokens:
                raise ValueError(f"max_num_batched_tokens {max_num_batched_tokens} exceeds the "
                                 f"{self.config.max_num_batched_tokens} the engine started with (its activation "
                                 f"memory is sized for that)")
            seqs = max_num_seqs if max_num_seqs is not None else self.scheduler.limits.max_num_seqs
            if max_num_batched_tokens < seqs:
                raise ValueError(f"max_num_batched_tokens {max_num_batched_tokens} must be >= max_num_seqs ({seqs})")
        if max_model_len is not None:
            positive_int("max_model_len", max_model_len)
            self._check_max_model_len(max_model_len)
        if num_speculative_tokens is not None:
            if self.speculator is None:
                raise ValueError("num_speculative_tokens: speculation is not configured "
                                 "(start the engine with speculative_config)")
            check_num_speculative_tokens(num_speculative_tokens, self.speculator.config.num_speculative_tokens)
            self.speculator.num_speculative_tokens = num_speculative_tokens
        if max_num_seqs is not None:
            self.scheduler.limits.max_num_seqs = max_num_seqs
        if max_model_len is not None:
            self.scheduler.limits.max_model_len = max_model_len
        if max_num_batched_tokens is not None:
            self.scheduler.limits.max_num_batched_tokens = max_num_batched_tokens

    # --- requests ----------------------------------------------------------------------
    def _encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids; the one check of a token-id prompt (the server's included)."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt must not be empty", "prompt")
            return self.tokenizer.encode(prompt)
        try:
            return token_ids("prompt token ids", list(prompt), self.runner.vocab_size)
        except ValueError as exc:
            raise RequestError(str(exc), "prompt") from None

    def _resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The one resolution of max_tokens against max_model_len (None: all the room left);
        LengthError naming both numbers when they do not fit."""
        limit = self.max_model_len
        if params.max_tokens is None:
            if num_prompt_tokens >= limit:
                raise LengthError(
                    f"the prompt has {num_prompt_tokens} tokens, which leaves no room under "
                    f"max_model_len ({limit})", "prompt"
                )
            return limit - num_prompt_tokens
        if num_prompt_tokens + params.max_tokens > limit:
            raise LengthError(
                f"the prompt has {num_prompt_tokens} tokens and max_tokens is {params.max_tokens}: "
                f"{num_prompt_tokens + params.max_tokens} exceeds max_model_len ({limit})", "max_tokens"
            )
        return params.max_tokens

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams,
        arrival_time: float | None = None, service_tier: str = "default",
    ) -> None:
        """Validate and queue a request (n children for n > 1): the edge where every caller's
        request (the server's, the offline LLM's, the simulator's) is checked and resolved,
        once. RequestError (a ValueError naming the field) on bad input."""
        if service_tier not in SERVICE_TIERS:
            raise RequestError(f"service_tier must be one of {list(SERVICE_TIERS)}, got {service_tier!r}",
                               "service_tier")
        prompt_ids = self._encode_prompt(prompt)
        max_tokens = self._resolve_max_tokens(len(prompt_ids), params)
        if self.outputs.has(request_id):
            raise RequestError(f"request_id {request_id!r} is already in use", "request_id")
        stop_ids = frozenset(params.stop_token_ids or ()) | (
            frozenset() if params.ignore_eos else self.tokenizer.eos_token_ids
        )
        arrival = arrival_time if arrival_time is not None else self.clock.now()
        base_seed = params.seed if params.seed is not None else _prompt_seed(prompt_ids, self.config.seed)
        children = [
            Request(
                request_id=f"{request_id}#{i}", prompt_token_ids=prompt_ids,
                sampling_params=params, max_tokens=max_tokens, stop_token_ids=stop_ids,
                seed=base_seed + i, service_tier=service_tier, times=RequestTimes(arrival=arrival),
                sample=SampleState(generator=self.runner.make_generator(params.seed + i)
                                   if params.seed is not None else None),
            )
            for i in range(params.n)
        ]
        group = RequestGroup(request_id, prompt if isinstance(prompt, str) else None, prompt_ids, children)
        self.outputs.add(group)
        for req in group.children:
            self.scheduler.add_request(req)

    def abort_request(self, request_id: str, *, reason: str = "abort") -> None:
        """Ends every unfinished choice of a request; `reason` is the metrics' finished_reason
        ("error" when the engine failed on it)."""
        group = self.outputs.group(request_id)
        if group is None:
            return  # finished already, or never added
        for req in group.children:
            if not req.status.finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                self.outputs.on_finished(req)
                if self.latency_sink is not None:
                    self.latency_sink.record_finished(finished_record(req, reason, self.outputs.group_summary(req)))
        self.outputs.drop(group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # --- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            self._left_work = False
            return []
        scheduled.follows_previous = self._left_work
        result, failed = run_isolating(self.runner.run, scheduled)
        if failed:
            result = without(result, {req.out.group for req in failed})
        appended = self.scheduler.update(scheduled, result.requests, result.token_ids)
        if self.speculator is not None:
            self.speculator.record(scheduled, result)
        outputs = self._emit(result.requests, appended, result.logprobs, failed)
        if failed:
            outputs += self._fail(failed)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        self._left_work = self.has_unfinished_requests()
        return outputs

    @property
    def left_work(self) -> bool:
        """Whether the last step ended with requests unfinished (the next one follows it)."""
        return self._left_work

    def emit_decoded(self, token_ids: list[list[int]], last_token_time: float) -> None:
        """Apply a run of decode-only steps the fleet's fast-forward took (engine/fleet/
        fast_forward.py; it times them, records their gaps and allocates their slots): each
        running request's tokens, aligned with scheduler.running, none ending it, the last
        at `last_token_time`."""
        self.scheduler.take_freed()  # the simulated executor has no rows to free
        for req, ids in zip(self.scheduler.running, token_ids):
            self.scheduler.append_decoded(req, ids)
            self.outputs.on_decoded(req, ids)
            req.times.last_token = last_token_time
            self.generation_tokens_total += len(ids)
        self._left_work = True

    def _fail(self, failed: dict[Request, Exception]) -> list[RequestOutput]:
        """End each failed request's whole group (its other choices too) as aborted, with
        an error saying so; the exception itself stays in the log."""
        outputs = []
        for group in {req.out.group.request_id: req.out.group for req in failed}.values():
            reason = next(type(e).__name__ for r, e in failed.items() if r.out.group is group)
            self.abort_request(group.request_id, reason="error")
            outputs.append(RequestOutput(
                request_id=group.request_id, prompt=group.prompt,
                prompt_token_ids=group.prompt_token_ids,
                outputs=[c.out.completion for c in group.children], finished=True,
                error=f"the engine failed on this request ({reason}); other requests were not affected"))
        return outputs

    def _emit(self, progressed: list[Request], appended: list[int], logprobs,
              failed: dict[Request, Exception]) -> list[RequestOutput]:
        """Record each request's new tokens; a request whose output processing raises
        joins `failed`."""
        now = self.clock.now()
        ok = []
        prefilled = generated = 0  # prompt tokens computed for requests whose first token came
        for k, req in enumerate(progressed):
            try:
                p, g = self._emit_one(req, appended[k], logprobs[k] if logprobs is not None else None, now)
                prefilled, generated = prefilled + p, generated + g
                ok.append(req)
            except Exception as exc:
                log.exception("output processing failed for request %s", req.request_id)
                failed[req] = exc
        self.generation_tokens_total += generated
        if self.latency_sink is not None:  # vLLM's tokens per engine step
            self.latency_sink.record_iteration_tokens(prefilled + generated)
        if len(ok) < len(progressed):
            dropped = {req.out.group for req in failed}
            ok = [req for req in ok if req.out.group not in dropped]
        return self.outputs.collect(ok)

    def _emit_one(self, req: Request, num_new: int, logprobs, now: float) -> tuple[int, int]:
        """Records a request's `num_new` newest tokens (a stop string may end it at any of
        them; the rest are dropped); returns the prompt tokens computed (not cached) when
        the first token came this step, and the tokens emitted."""
        sink = self.latency_sink
        times = req.times
        prefilled = 0
        first = len(req.output_token_ids) - num_new  # the output's length before this step
        if first == 0:
            cached = req.num_cached_tokens or 0
            self.prompt_tokens_total += req.num_prompt_tokens
            self.prompt_tokens_cached_total += cached
            prefilled = req.num_prompt_tokens - cached
            times.first_token = now
            if sink is not None and self.outputs.first_token_of_group(req):
                sink.record_first_token(now - times.arrival)
        elif sink is not None:  # one gap per step, as vLLM's with speculation
            sink.record_inter_token(now - times.last_token)
        times.last_token = now
        stop, emitted = self.outputs.on_new_tokens(req, num_new, logprobs)
        if stop is not None:
            self.scheduler.stop(req, stop, num_dropped=num_new - emitted)
        if req.status.finished:
            self.outputs.on_finished(req)
            if sink is not None:
                sink.record_finished(finished_record(req, req.status.value, self.outputs.group_summary(req)))
        return prefilled, emitted

    def stats(self) -> EngineStats:
        prefix = self.kv_cache.prefix_stats
        return EngineStats(
            executor_counters=self.runner.counters(),
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_queued,
            num_preempted_waiting=self.scheduler.num_preempted_waiting,
            kv_cache_usage=self.kv_cache.usage,
            num_kv_blocks=self.kv_cache.num_blocks,
            num_preemptions_total=self.scheduler.num_preemptions,
            prefix_cache_queries_total=prefix.queries,
            prefix_cache_hits_total=prefix.hits,
            prompt_tokens_total=self.prompt_tokens_total,
            prompt_tokens_cached_total=self.prompt_tokens_cached_total,
            generation_tokens_total=self.generation_tokens_total,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            spec_decode=None if self.speculator is None else self.speculator.stats.copy(),
            num_speculative_tokens=None if self.speculator is None else self.speculator.num_speculative_tokens,
        )
