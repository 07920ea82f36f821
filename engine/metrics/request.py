"""vLLM's per-request and per-step histograms beyond latency (phase times, preemptions,
the request's parameters, tokens per step), with vLLM's names, buckets and semantics
(vllm/v1/metrics/loggers.py); ServerMetrics owns one of these and feeds it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from ..core.latency import FinishedRequest
from .buckets import (ITERATION_TOKENS_BUCKETS, REQUEST_LATENCY_BUCKETS, REQUEST_NUM_PREEMPTIONS_BUCKETS,
                              REQUEST_PARAMS_N_BUCKETS)


class RequestHistograms:
    def __init__(self, registry: CollectorRegistry, labels: list[str], values: tuple[str, ...],
                 token_buckets: list[int]) -> None:
        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=registry).labels(*values)

        phase = "Histogram of time spent in {} phase for request."
        self.prefill_time = histogram("vllm:request_prefill_time_seconds", phase.format("PREFILL"),
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds", phase.format("DECODE"),
                                     REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds", phase.format("RUNNING"),
                                        REQUEST_LATENCY_BUCKETS)
        self.num_preemptions = histogram("vllm:request_num_preemptions",
                                         "Histogram of the number of times a request was preempted.", REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.prefill_kv_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).", token_buckets)
        self.max_tokens_param = histogram("vllm:request_params_max_tokens",
                                          "Histogram of the max_tokens request parameter.", token_buckets)
        self.n_param = histogram("vllm:request_params_n", "Histogram of the n request parameter.",
                                 REQUEST_PARAMS_N_BUCKETS)
        self.max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", token_buckets)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS)

    def record_finished(self, req: FinishedRequest) -> None:
        # A phase that never began (aborted while waiting) has no duration: vLLM would record
        # a difference against an unset timestamp; nothing is recorded here.
        for histogram, seconds in ((self.prefill_time, req.prefill_time), (self.decode_time, req.decode_time),
                                   (self.inference_time, req.inference_time)):
            if seconds is not None:
                histogram.observe(max(seconds, 0.0))
        self.num_preemptions.observe(req.num_preemptions)
        self.prefill_kv_computed.observe(req.num_prompt_tokens - max(req.num_cached_tokens, 0))
        if req.max_tokens_param:
            self.max_tokens_param.observe(req.max_tokens_param)
        if req.group is not None:  # once per user request, when its last choice finishes
            self.n_param.observe(req.group.n)
            self.max_num_generation_tokens.observe(req.group.max_num_generation_tokens)

    def record_iteration_tokens(self, num_tokens: int) -> None:
        self.iteration_tokens.observe(num_tokens)
