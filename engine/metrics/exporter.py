"""Prometheus collectors with vLLM's names, labels and bucket boundaries, so a stock vLLM
dashboard (and kvpilot's operator) read this server like a vLLM pod. One registry per
server instance; nothing module-global is mutated."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from ..core.latency import FinishedRequest
from .buckets import (CACHE_HIT_SOURCES, ENGINE_INDEX, FINISH_REASONS,  # noqa: F401
                              PROMPT_TOKEN_SOURCES, REQUEST_LATENCY_BUCKETS, SERVICE_TIERS, SIMULATED_COUNTERS,
                              SLEEP_STATES, TIER_TPOT_METRIC, TOKEN_LATENCY_BUCKETS, TTFT_BUCKETS, WAITING_REASONS,
                              buckets_1_2_5)
from ..core.outputs import EngineStats
from .request import RequestHistograms
from .spec import SpecDecodeMetrics


class ServerMetrics:
    """`max_model_len` is the largest the server may ever serve (a live change can raise it
    up to the engine's ceiling): the token-count buckets are fixed at start, so they reach
    that far, or long requests after a raise would all land in +Inf."""

    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, CPU seconds, fds
        labels = ["model_name", "engine"]
        values = (model_name, ENGINE_INDEX)
        r = self.registry

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(*values)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(*values)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        # New arrivals only, so it never passes --max-queued-requests; requests preempted
        # back into the queue are the next gauge (vLLM counts them here; it has no cap).
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.preempted_waiting = gauge(
            "kvpilot:num_requests_preempted", "Requests preempted (KV dropped for recompute) and waiting "
            "to resume; in neither vllm:num_requests_running nor vllm:num_requests_waiting.")
        by_reason = Gauge("vllm:num_requests_waiting_by_reason",
                          "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
                          "scheduling capacity; 'deferred' = deferred by transient constraints. Sum of all "
                          "reasons equals vllm:num_requests_waiting.", labels + ["reason"], registry=r)
        self.waiting_by_reason = {reason: by_reason.labels(*values, reason) for reason in WAITING_REASONS}
        sleep = Gauge("vllm:engine_sleep_state", "Engine sleep state; awake = 0 means engine is sleeping; "
                      "awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; "
                      "discard_all = 1 means sleep level 2.", labels + ["sleep_state"], registry=r)
        for state in SLEEP_STATES:  # kvpilot never sleeps
            sleep.labels(*values, state).set(1 if state == "awake" else 0)
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = counter("vllm:num_preemptions",
                                   "Cumulative number of preemption from the engine.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        by_source = Counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                            labels + ["source"], registry=r)
        self.prompt_by_source = {s: by_source.labels(*values, s) for s in PROMPT_TOKEN_SOURCES}
        self.prompt_cached = counter("vllm:prompt_tokens_cached",
                                     "Number of cached prompt tokens (local + external).")
        cached_by_source = Counter(
            "vllm:prompt_tokens_cached_by_source", "Prefix-cache hit tokens by the cache tier that supplied "
            "them: device (local HBM), host (offloaded to DRAM), disk, p2p (transferred from another "
            "instance) or external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
            "vllm:external_prefix_cache_hits.", labels + ["source"], registry=r)
        self.cached_by_source = {s: cached_by_source.labels(*values, s) for s in CACHE_HIT_SOURCES}
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          labels + ["finished_reason"], registry=r)
        self.success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.",
                              TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.",
                               REQUEST_LATENCY_BUCKETS)
        token_buckets = buckets_1_2_5(max_model_len)
        self.requests = RequestHistograms(r, labels, values, token_buckets)
        self.req_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                           "Number of prefill tokens processed.", token_buckets)
        self.req_generation_tokens = histogram("vllm:request_generation_tokens",
                                               "Number of generation tokens processed.", token_buckets)
        kv_labels = ["model_name"]
        self.max_num_seqs = Gauge("kvpilot:max_num_seqs", "max_num_seqs in effect (live-tunable).",
                                  kv_labels, registry=r).labels(model_name)
        self.max_model_len = Gauge("kvpilot:max_model_len", "max_model_len in effect (live-tunable).",
                                   kv_labels, registry=r).labels(model_name)
        # What the engine worked out at start-up, so the autotuner can run the KV sizing
        # formula backwards for any model without reading its config.
        self.kv_cache_bytes = Gauge("kvpilot:kv_cache_bytes", "Bytes allotted to the paged KV cache.",
                                    kv_labels, registry=r).labels(model_name)
        self.kv_bytes_per_token = Gauge(
            "kvpilot:kv_cache_bytes_per_token", "KV-cache bytes one token takes, all layers.",
            kv_labels, registry=r).labels(model_name)
        self.weight_bytes = Gauge("kvpilot:model_weight_bytes", "Bytes of model weights.",
                                  kv_labels, registry=r).labels(model_name)
        # 4 float32, 2 bf16/fp16, 1 fp8: what an fp8 cache would multiply capacity by.
        self.kv_element_bytes = Gauge(
            "kvpilot:kv_cache_element_bytes", "Bytes of one K or V element in the paged KV cache "
            "(its storage dtype: --kv-cache-dtype).", kv_labels, registry=r).labels(model_name)
        self.length_refusals = Counter(
            "kvpilot:request_length_refusals",
            "Requests refused because prompt + max_tokens exceeds max_model_len.",
            kv_labels, registry=r).labels(model_name)
        # vLLM's per-request TPOT split by OpenAI service tier: the autotuner holds its TPOT
        # objective on the tiers that want one, not on "flex" (batch) traffic. Every tier's
        # series exists from the start, so "no flex request finished" reads as 0, not absent.
        tier_tpot = Histogram(TIER_TPOT_METRIC, "Histogram of time_per_output_token_seconds per request, "
                              "by service tier.", kv_labels + ["service_tier"], buckets=TOKEN_LATENCY_BUCKETS,
                              registry=r)
        self.tier_tpot = {tier: tier_tpot.labels(model_name, tier) for tier in SERVICE_TIERS}
        self._last: EngineStats | None = None
        self._spec: SpecDecodeMetrics | None = None  # made on the first stats of a speculating engine
        self._executor: dict[str, Counter] = {}  # simulated pods only

    def record_simulation(self, accelerator: str, model: str) -> None:
        """Mark this server as simulated (kvpilot:simulated_info) and export the simulated
        executor's step counters, so dashboards and the operator can tell."""
        labels = ["model_name"]
        Gauge("kvpilot:simulated_info", "1 on a simulated accelerator (the forward pass is a timing model).",
              labels + ["accelerator", "model"], registry=self.registry).labels(
            self.model_name, accelerator, model).set(1)
        for key, doc in SIMULATED_COUNTERS.items():
            self._executor[key] = Counter(f"kvpilot:{key}", doc, labels, registry=self.registry).labels(
                self.model_name)

    def record_cache_config(self, **config: object) -> None:
        """vllm:cache_config_info: a gauge at 1 whose labels are the cache settings (vLLM's
        key names), read by the stock dashboards' cache panel."""
        info = {key: str(value) for key, value in config.items()}
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
              [*info, "engine"], registry=self.registry).labels(*info.values(), ENGINE_INDEX).set(1)

    def record_capacity(self, kv_cache_bytes: int, kv_bytes_per_token: int, weight_bytes: int,
                        kv_cache_element_bytes: int) -> None:
        self.kv_cache_bytes.set(kv_cache_bytes)
        self.kv_bytes_per_token.set(kv_bytes_per_token)
        self.weight_bytes.set(weight_bytes)
        self.kv_element_bytes.set(kv_cache_element_bytes)

    def record_stats(self, stats: EngineStats) -> None:
        """Gauges take the current value; counters grow by the change since the last call."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.preempted_waiting.set(stats.num_preempted_waiting)
        self.waiting_by_reason["capacity"].set(stats.num_waiting)  # nothing here is deferred
        self.kv_usage.set(stats.kv_cache_usage)
        self.max_num_seqs.set(stats.max_num_seqs)
        self.max_model_len.set(stats.max_model_len)
        last = self._last
        for counter, field in (
            (self.preemptions, "num_preemptions_total"),
            (self.prefix_queries, "prefix_cache_queries_total"),
            (self.prefix_hits, "prefix_cache_hits_total"),
            (self.prompt_tokens, "prompt_tokens_total"),
            (self.prompt_cached, "prompt_tokens_cached_total"),
            (self.prompt_by_source["local_cache_hit"], "prompt_tokens_cached_total"),
            (self.cached_by_source["device"], "prefix_cache_hits_total"),
            (self.generation_tokens, "generation_tokens_total"),
        ):
            delta = getattr(stats, field) - (getattr(last, field) if last else 0)
            if delta > 0:
                counter.inc(delta)
        computed = stats.prompt_tokens_total - stats.prompt_tokens_cached_total
        computed_before = (last.prompt_tokens_total - last.prompt_tokens_cached_total) if last else 0
        if computed > computed_before:
            self.prompt_by_source["local_compute"].inc(computed - computed_before)
        if stats.spec_decode is not None:
            if self._spec is None:
                self._spec = SpecDecodeMetrics(self.registry, self.model_name, len(stats.spec_decode.accepted_per_pos))
            self._spec.record(stats.spec_decode, last.spec_decode if last else None, stats.num_speculative_tokens)
        for key, counter in self._executor.items():
            delta = stats.executor_counters.get(key, 0.0) - (last.executor_counters.get(key, 0.0) if last else 0.0)
            if delta > 0:
                counter.inc(delta)
        self._last = stats

    def record_first_token(self, ttft: float) -> None:
        self.ttft.observe(max(ttft, 0.0))

    def record_inter_token(self, latency: float) -> None:
        self.itl.observe(max(latency, 0.0))

    def record_iteration_tokens(self, num_tokens: int) -> None:
        self.requests.record_iteration_tokens(num_tokens)

    def record_finished(self, req: FinishedRequest) -> None:
        self.success[req.finish_reason if req.finish_reason in self.success else "stop"].inc()
        self.requests.record_finished(req)
        self.e2e.observe(max(req.e2e_latency, 0.0))
        if req.queue_time is not None:
            self.queue.observe(max(req.queue_time, 0.0))
        self.req_prompt_tokens.observe(req.num_prompt_tokens)
        self.req_generation_tokens.observe(req.num_generation_tokens)
        # vLLM records a TPOT of 0 for a request with fewer than two tokens (no gap to average);
        # kvpilot's per-tier series, which the autotuner's objective reads, leaves them out.
        tpot = req.mean_time_per_output_token
        self.tpot.observe(max(tpot, 0.0) if tpot is not None else 0.0)
        if tpot is not None:
            self.tier_tpot[req.service_tier].observe(max(tpot, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
