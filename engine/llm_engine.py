"""The synchronous engine: add requests, step (schedule, run, update), read outputs."""

from __future__ import annotations

import logging
import time

import torch

from .config import EngineConfig
from .kv_cache_manager import KVCacheManager
from .model_config import DTYPES, ModelConfig
from .model_runner import ModelRunner
from .model_source import resolve_model
from .output_processor import OutputProcessor
from .outputs import EngineStats, RequestOutput
from .quantity import format_bytes
from .request import Request, RequestStatus
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerLimits
from .tokenizer import Tokenizer

log = logging.getLogger("kvpilot.engine")


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is cuda but no CUDA device is available")
    return torch.device(name)


def _pick_dtype(name: str, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    dtype = DTYPES[model_cfg.torch_dtype]
    if device.type == "cpu" and dtype == torch.float16:
        return torch.float32  # fp16 matmuls are slow or missing on CPUs
    return dtype


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = resolve_model(config.model)
        self.model_config = ModelConfig.from_dir(model_dir)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.device = _pick_device(config.device)
        self.dtype = _pick_dtype(config.dtype, self.model_config, self.device)
        torch.manual_seed(config.seed)
        self.max_position_embeddings = self.model_config.max_position_embeddings
        max_model_len = config.max_model_len or self.max_position_embeddings
        if max_model_len > self.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({max_model_len}) exceeds the model's max_position_embeddings "
                f"({self.max_position_embeddings})"
            )
        self.runner = ModelRunner(
            config, self.model_config, str(model_dir), self.device, self.dtype, max_model_len
        )
        num_blocks = self._num_kv_blocks()
        self.kv_capacity_tokens = num_blocks * config.block_size
        self._check_fits(max_model_len)
        self.runner.allocate_kv_cache(num_blocks)
        log.info(
            "KV cache: %d blocks of %d tokens (%s, %d tokens); attention backend %s; %s on %s",
            num_blocks, config.block_size, format_bytes(num_blocks * self.runner.kv_bytes_per_block),
            self.kv_capacity_tokens, self.runner.backend, self.dtype, self.device,
        )
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerLimits(config.max_num_seqs, config.max_num_batched_tokens, max_model_len),
            self.kv_cache,
        )
        self.outputs = OutputProcessor(self.tokenizer)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def _num_kv_blocks(self) -> int:
        per_block = self.runner.kv_bytes_per_block
        if self.device.type == "cuda" and self.config.kv_cache_memory is None:
            total = torch.cuda.get_device_properties(self.device).total_memory
            peak = self.runner.profile_peak_bytes(self.config.max_num_batched_tokens)
            budget = int(total * self.config.gpu_memory_utilization) - peak
        else:
            budget = self.config.kv_cache_memory or (1 << 30)
        return max(budget // per_block, 0)

    def _check_fits(self, max_model_len: int) -> None:
        if self.kv_capacity_tokens < max_model_len:
            raise ValueError(
                f"the KV cache holds {self.kv_capacity_tokens} tokens but max_model_len is "
                f"{max_model_len}: one full-length sequence would not fit. Lower max_model_len "
                f"to at most {self.kv_capacity_tokens} or give the cache more memory "
                f"(kv_cache_memory / gpu_memory_utilization)."
            )

    @property
    def kv_bytes_per_token(self) -> int:
        return self.runner.kv_bytes_per_block // self.config.block_size

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_capacity_tokens * self.kv_bytes_per_token

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.runner.model.parameters())

    # --- limits that can change while serving ----------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.scheduler.limits.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.limits.max_num_seqs

    def update_limits(self, *, max_num_seqs: int | None = None, max_model_len: int | None = None) -> None:
        """Apply live-tunable limits; ValueError (naming the field) leaves both unchanged."""
        if max_num_seqs is not None and (
            isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1
        ):
            raise ValueError(f"max_num_seqs must be a positive integer, got {max_num_seqs!r}")
        if max_model_len is not None:
            if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
                raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}")
            if max_model_len > self.max_position_embeddings:
                raise ValueError(
                    f"max_model_len ({max_model_len}) exceeds the model's max_position_embeddings "
                    f"({self.max_position_embeddings})"
                )
            self._check_fits(max_model_len)
        if max_num_seqs is not None:
            self.scheduler.limits.max_num_seqs = max_num_seqs
        if max_model_len is not None:
            self.scheduler.limits.max_model_len = max_model_len

    # --- requests ----------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {t!r}")
        return ids

    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        limit = self.max_model_len
        if params.max_tokens is None:
            if num_prompt_tokens >= limit:
                raise ValueError(
                    f"the prompt has {num_prompt_tokens} tokens, which leaves no room under "
                    f"max_model_len ({limit})"
                )
            return limit - num_prompt_tokens
        if num_prompt_tokens + params.max_tokens > limit:
            raise ValueError(
                f"the prompt has {num_prompt_tokens} tokens and max_tokens is {params.max_tokens}: "
                f"{num_prompt_tokens + params.max_tokens} exceeds max_model_len ({limit})"
            )
        return params.max_tokens

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request (n children for n > 1). ValueError on bad input."""
        prompt_ids = self.encode_prompt(prompt)
        max_tokens = self.resolve_max_tokens(len(prompt_ids), params)
        if self.outputs.has(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        stop_ids = frozenset(params.stop_token_ids or ()) | (
            frozenset() if params.ignore_eos else self.tokenizer.eos_token_ids
        )
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        children = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(params.seed + i)
            req = Request(
                request_id=f"{request_id}#{i}", prompt_token_ids=prompt_ids,
                sampling_params=params, max_tokens=max_tokens, stop_token_ids=stop_ids,
                generator=gen,
            )
            req.times.arrival = arrival
            children.append(req)
        self.outputs.add(request_id, prompt if isinstance(prompt, str) else None, prompt_ids, children)
        for req in children:
            self.scheduler.add_request(req)

    def abort_request(self, request_id: str) -> None:
        for child_id in self.outputs.children(request_id):
            req = self.scheduler.abort(child_id)
            if req is not None:
                self.outputs.on_finished(req)
        self.outputs.drop(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # --- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return []
        tables = [self.kv_cache.block_ids(s.request.request_id) for s in scheduled.scheduled]
        result = self.runner.run(scheduled, tables)
        sampled = dict(zip(result.request_ids, result.sampled.token_ids.tolist()))
        progressed = self.scheduler.update(scheduled, sampled)
        return self._emit(progressed, result)

    def _emit(self, progressed: list[Request], result) -> list[RequestOutput]:
        now = time.monotonic()
        logprobs = self.outputs.logprob_rows(result)
        for req in progressed:
            self.generation_tokens_total += 1
            if len(req.output_token_ids) == 1:
                self.prompt_tokens_total += req.num_prompt_tokens
                req.times.first_token = now
            req.times.last_token = now
            stop = self.outputs.on_token(req, logprobs.get(req.request_id))
            if stop is not None and not req.status.finished:
                req.stop_reason = stop
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
            if req.status.finished:
                self.outputs.on_finished(req)
        return self.outputs.collect(progressed)

    def stats(self) -> EngineStats:
        prefix = self.kv_cache.prefix_stats
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv_cache.usage,
            num_kv_blocks=self.kv_cache.num_blocks,
            num_preemptions_total=self.scheduler.num_preemptions,
            prefix_cache_queries_total=prefix.queries,
            prefix_cache_hits_total=prefix.hits,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
        )
