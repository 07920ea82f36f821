"""A simulated replica's metrics, kept as plain numbers and read the way Prometheus
reads a pod: the same series names, labels and bucket boundaries as `kvpilot serve`'s
/metrics (vLLM's), sampled at scrape times on the virtual clock. prometheus_client's own
collectors would cost a lock and a bisect per token; this keeps them as counts."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from ..core.latency import FinishedRequest
from ..metrics.buckets import (CACHE_HIT_SOURCES, ENGINE_INDEX, FINISH_REASONS, ITERATION_TOKENS_BUCKETS,
                              PROMPT_TOKEN_SOURCES, REQUEST_LATENCY_BUCKETS, REQUEST_NUM_PREEMPTIONS_BUCKETS,
                              REQUEST_PARAMS_N_BUCKETS, SERVICE_TIERS, SIMULATED_COUNTERS, SLEEP_STATES,
                              TIER_TPOT_METRIC, TOKEN_LATENCY_BUCKETS, TTFT_BUCKETS, WAITING_REASONS,
                              buckets_1_2_5)
from ..core.outputs import EngineStats
from .log_histogram import LogHistogram


class Histogram:
    def __init__(self, bounds: tuple[float, ...] | list[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            total += n
            out.append(("+Inf" if bound == float("inf") else _le(bound), total))
        return out


def _le(bound: float) -> str:
    """An `le` label as prometheus_client writes it (floats: 0.5, 1.0, 20.0)."""
    return repr(float(bound))


@dataclass
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass
class ReplicaMetrics:
    model_name: str
    max_model_len: int
    running: float = 0.0
    waiting: float = 0.0
    preempted: float = 0.0  # waiting to resume after a preemption (not in waiting)
    kv_usage: float = 0.0
    max_num_seqs: float = 0.0
    max_model_len_live: float = 0.0
    counters: dict[str, float] = field(default_factory=lambda: {
        "vllm:num_preemptions_total": 0.0, "vllm:prefix_cache_queries_total": 0.0,
        "vllm:prefix_cache_hits_total": 0.0, "vllm:prompt_tokens_total": 0.0,
        "vllm:generation_tokens_total": 0.0, "vllm:prompt_tokens_cached_total": 0.0})
    prompt_by_source: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PROMPT_TOKEN_SOURCES, 0.0))
    cached_by_source: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CACHE_HIT_SOURCES, 0.0))
    success: dict[str, float] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0.0))
    capacity: dict[str, float] = field(default_factory=dict)
    length_refusals: float = 0.0
    simulation: tuple[str, str] | None = None  # (accelerator, model) once record_simulation ran
    executor: dict[str, float] = field(default_factory=dict)
    # Speculative decoding (the engine's SpecDecodeStats and K in effect); None unless it speculates.
    spec_decode: object = None
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        tokens = buckets_1_2_5(self.max_model_len)
        self.histograms = {
            "vllm:time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
            "vllm:inter_token_latency_seconds": Histogram(TOKEN_LATENCY_BUCKETS),
            "vllm:request_time_per_output_token_seconds": Histogram(TOKEN_LATENCY_BUCKETS),
            "vllm:e2e_request_latency_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "vllm:request_queue_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "vllm:request_prompt_tokens": Histogram(tokens),
            "vllm:request_generation_tokens": Histogram(tokens),
            "vllm:request_prefill_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "vllm:request_decode_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "vllm:request_inference_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "vllm:request_num_preemptions": Histogram(REQUEST_NUM_PREEMPTIONS_BUCKETS),
            "vllm:request_prefill_kv_computed_tokens": Histogram(tokens),
            "vllm:request_params_max_tokens": Histogram(tokens),
            "vllm:request_params_n": Histogram(REQUEST_PARAMS_N_BUCKETS),
            "vllm:request_max_num_generation_tokens": Histogram(tokens),
            "vllm:iteration_tokens_total": Histogram(ITERATION_TOKENS_BUCKETS),
        }
        self.tier_tpot = {tier: Histogram(TOKEN_LATENCY_BUCKETS) for tier in SERVICE_TIERS}
        self._ttft = self.histograms["vllm:time_to_first_token_seconds"]
        self._itl = self.histograms["vllm:inter_token_latency_seconds"]
        self.itl_fine = LogHistogram()  # the same gaps at 1 % resolution, for the report
        # A step gives most running sequences the same gap: count repeats, observe once.
        self._gap, self._gap_repeats = 0.0, 0

    # --- the server's ServerMetrics interface ---------------------------------------------
    def record_capacity(self, kv_cache_bytes: int, kv_bytes_per_token: int, weight_bytes: int,
                        kv_cache_element_bytes: int) -> None:
        self.capacity = {"kvpilot:kv_cache_bytes": kv_cache_bytes,
                         "kvpilot:kv_cache_bytes_per_token": kv_bytes_per_token,
                         "kvpilot:model_weight_bytes": weight_bytes,
                         "kvpilot:kv_cache_element_bytes": kv_cache_element_bytes}

    def record_simulation(self, accelerator: str, model: str) -> None:
        self.simulation = (accelerator, model)

    def record_stats(self, s: EngineStats) -> None:
        self.running, self.waiting, self.kv_usage = s.num_running, s.num_waiting, s.kv_cache_usage
        self.preempted = s.num_preempted_waiting
        self.max_num_seqs, self.max_model_len_live = s.max_num_seqs, s.max_model_len
        c = self.counters
        c["vllm:num_preemptions_total"] = s.num_preemptions_total
        c["vllm:prefix_cache_queries_total"] = s.prefix_cache_queries_total
        c["vllm:prefix_cache_hits_total"] = s.prefix_cache_hits_total
        c["vllm:prompt_tokens_total"] = s.prompt_tokens_total
        c["vllm:generation_tokens_total"] = s.generation_tokens_total
        c["vllm:prompt_tokens_cached_total"] = s.prompt_tokens_cached_total
        self.prompt_by_source["local_compute"] = s.prompt_tokens_total - s.prompt_tokens_cached_total
        self.prompt_by_source["local_cache_hit"] = s.prompt_tokens_cached_total
        self.cached_by_source["device"] = s.prefix_cache_hits_total
        self.executor = s.executor_counters
        self.spec_decode, self.num_speculative_tokens = s.spec_decode, s.num_speculative_tokens

    def record_first_token(self, ttft: float) -> None:
        self._ttft.observe(max(ttft, 0.0))

    def record_inter_token(self, latency: float, times: int = 1) -> None:
        """One gap between a sequence's tokens (or `times` equal ones, as many calls would)."""
        if latency == self._gap:
            self._gap_repeats += times
            return
        self.flush()
        self._gap, self._gap_repeats = latency, times

    def flush(self) -> None:
        """Observe the repeated gaps counted so far (a scrape or a report calls this)."""
        if self._gap_repeats:
            self._itl.observe(max(self._gap, 0.0), self._gap_repeats)
            self.itl_fine.observe(self._gap, self._gap_repeats)
            self._gap_repeats = 0

    def record_iteration_tokens(self, num_tokens: int, times: int = 1) -> None:
        self.histograms["vllm:iteration_tokens_total"].observe(num_tokens, times)

    def record_finished(self, req: FinishedRequest) -> None:
        """As ServerMetrics.record_finished (its request_metrics.py says what each one holds)."""
        self.success[req.finish_reason if req.finish_reason in self.success else "stop"] += 1
        h = self.histograms
        for name, seconds in (("prefill", req.prefill_time), ("decode", req.decode_time),
                              ("inference", req.inference_time)):
            if seconds is not None:
                h[f"vllm:request_{name}_time_seconds"].observe(max(seconds, 0.0))
        h["vllm:request_num_preemptions"].observe(req.num_preemptions)
        h["vllm:request_prefill_kv_computed_tokens"].observe(req.num_prompt_tokens - max(req.num_cached_tokens, 0))
        if req.max_tokens_param:
            h["vllm:request_params_max_tokens"].observe(req.max_tokens_param)
        if req.group is not None:
            h["vllm:request_params_n"].observe(req.group.n)
            h["vllm:request_max_num_generation_tokens"].observe(req.group.max_num_generation_tokens)
        h["vllm:e2e_request_latency_seconds"].observe(max(req.e2e_latency, 0.0))
        if req.queue_time is not None:
            h["vllm:request_queue_time_seconds"].observe(max(req.queue_time, 0.0))
        h["vllm:request_prompt_tokens"].observe(req.num_prompt_tokens)
        h["vllm:request_generation_tokens"].observe(req.num_generation_tokens)
        tpot = req.mean_time_per_output_token  # vLLM's 0 below two tokens; the tier series skip it
        h["vllm:request_time_per_output_token_seconds"].observe(max(tpot, 0.0) if tpot is not None else 0.0)
        if tpot is not None:
            self.tier_tpot[req.service_tier].observe(max(tpot, 0.0))

    # --- a scrape -------------------------------------------------------------------------
    def samples(self) -> list[Sample]:
        """Every series a scrape of /metrics would return, with its current value."""
        self.flush()
        base = {"model_name": self.model_name, "engine": ENGINE_INDEX}
        own = {"model_name": self.model_name}
        out = [Sample("vllm:num_requests_running", base, self.running),
               Sample("vllm:num_requests_waiting", base, self.waiting),
               Sample("kvpilot:num_requests_preempted", base, self.preempted),
               *[Sample("vllm:num_requests_waiting_by_reason", {**base, "reason": r},
                        self.waiting if r == "capacity" else 0.0) for r in WAITING_REASONS],
               *[Sample("vllm:engine_sleep_state", {**base, "sleep_state": st}, 1.0 if st == "awake" else 0.0)
                 for st in SLEEP_STATES],
               Sample("vllm:kv_cache_usage_perc", base, self.kv_usage),
               Sample("kvpilot:max_num_seqs", own, self.max_num_seqs),
               Sample("kvpilot:max_model_len", own, self.max_model_len_live)]
        out += [Sample(name, base, v) for name, v in self.counters.items()]
        out += [Sample("vllm:request_success_total", {**base, "finished_reason": r}, v)
                for r, v in self.success.items()]
        out += [Sample("vllm:prompt_tokens_by_source_total", {**base, "source": k}, v)
                for k, v in self.prompt_by_source.items()]
        out += [Sample("vllm:prompt_tokens_cached_by_source_total", {**base, "source": k}, v)
                for k, v in self.cached_by_source.items()]
        out += [Sample(name, own, float(v)) for name, v in self.capacity.items()]
        out.append(Sample("kvpilot:request_length_refusals_total", own, self.length_refusals))
        if self.simulation is not None:
            acc, model = self.simulation
            out.append(Sample("kvpilot:simulated_info", {**own, "accelerator": acc, "model": model}, 1.0))
            out += [Sample(f"kvpilot:{key}_total", own, float(self.executor.get(key, 0.0)))
                    for key in SIMULATED_COUNTERS]
        out += self._spec_samples(base, own)
        for name, h in self.histograms.items():
            out += [Sample(f"{name}_bucket", {**base, "le": le}, float(n)) for le, n in h.cumulative()]
            out += [Sample(f"{name}_sum", base, h.sum), Sample(f"{name}_count", base, float(h.count))]
        for tier, h in self.tier_tpot.items():
            labels = {**own, "service_tier": tier}
            out += [Sample(f"{TIER_TPOT_METRIC}_bucket", {**labels, "le": le}, float(n)) for le, n in h.cumulative()]
            out += [Sample(f"{TIER_TPOT_METRIC}_sum", labels, h.sum),
                    Sample(f"{TIER_TPOT_METRIC}_count", labels, float(h.count))]
        return out

    def _spec_samples(self, base: dict, own: dict) -> list[Sample]:
        """vllm:spec_decode_* and kvpilot:num_speculative_tokens, as the server's
        SpecDecodeMetrics exports them: only where the engine speculates."""
        st = self.spec_decode
        if st is None:
            return []
        out = [Sample("vllm:spec_decode_num_drafts_total", base, float(st.num_drafts)),
               Sample("vllm:spec_decode_num_draft_tokens_total", base, float(st.num_draft_tokens)),
               Sample("vllm:spec_decode_num_accepted_tokens_total", base, float(st.num_accepted_tokens))]
        out += [Sample("vllm:spec_decode_num_accepted_tokens_per_pos_total", {**base, "position": str(p)},
                       float(n)) for p, n in enumerate(st.accepted_per_pos)]
        if self.num_speculative_tokens is not None:
            out.append(Sample("kvpilot:num_speculative_tokens", own, float(self.num_speculative_tokens)))
        return out
