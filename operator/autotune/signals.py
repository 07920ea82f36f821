"""What the autotuner sees of one LLMDeployment over one window: a frozen `MetricsSnapshot`
of the engine's own signals, aggregated over its pods, plus which signals were missing
or stale. The Prometheus reader builds it; the policy only reads it."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Signals without which no decision is taken (the policy answers NoData instead).
REQUIRED_SIGNALS = (
    "kv_usage_mean",
    "kv_usage_max",
    "preemptions_per_s",
    "queue_time_p95_s",
    "num_waiting",
    "num_running",
    "request_rate_per_s",
)
# The TTFT and TPOT quantiles read beside p95 (ttft_p50_s ... tpot_p90_s): whether a replica
# can pay for itself (payoff.py).
LOWER_QUANTILES = (50, 75, 90)
# Signals some rules use when present; their absence disables only those rules.
OPTIONAL_SIGNALS = ("ttft_p95_s", "tpot_p95_s", "ttft_p50_s", "ttft_p75_s", "ttft_p90_s", "tpot_p50_s",
                    "tpot_p75_s", "tpot_p90_s", "aborted_per_s", "generation_tokens_per_s", "running_min",
                    "request_latency_mean_s",
                    "request_len_p99", "prefix_hit_rate", "length_refusals_per_s",
                    "kv_cache_bytes", "kv_bytes_per_token", "kv_cache_element_bytes", "weight_bytes",
                    "prompt_tokens_per_s", "tpot_mean_s",
                    "num_waiting_now", "flex_share", "prompt_len_mean",
                    "generation_len_mean", "spec_acceptance_rate", "spec_mean_accepted_len",
                    "spec_drafts_per_s", "num_speculative_tokens")


@dataclass(frozen=True)
class PodSettings:
    """The settings one pod reports in effect (`kvpilot:max_num_seqs`, `kvpilot:max_model_len`,
    `kvpilot:num_speculative_tokens`); None where the pod does not export the gauge (a stock
    vLLM pod; an engine that does not speculate)."""

    pod: str
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    num_speculative_tokens: int | None = None


@dataclass(frozen=True)
class MetricsSnapshot:
    """Deployment-wide signals over `window_s` seconds ending at `time` (unix seconds).

    Gauges are means over the window summed over pods (waiting, running), or mean/max
    over pods and the window (KV usage, 0..1). Rates are per second over the window.
    A quantile is None when its histogram exists but observed nothing in the window
    (no requests finished): that is "nothing happened", not missing data. A signal whose
    series does not exist at all is named in `missing`; one whose newest sample is too
    old is named in `stale`.
    """

    time: float
    window_s: float
    kv_usage_mean: float | None = None
    kv_usage_max: float | None = None
    preemptions_per_s: float | None = None
    queue_time_p95_s: float | None = None
    ttft_p95_s: float | None = None
    # p95 over requests of each one's mean time per output token: the requests a TPOT objective
    # covers, so all but OpenAI's "flex" tier where the pods export TPOT by tier (kvpilot's do).
    tpot_p95_s: float | None = None
    # Lower quantiles of the same two histograms (TPOT over every tier): the share of
    # requests over each objective, so whether a replica can pay for itself (payoff.py).
    ttft_p50_s: float | None = None
    ttft_p75_s: float | None = None
    ttft_p90_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_p75_s: float | None = None
    tpot_p90_s: float | None = None
    aborted_per_s: float | None = None  # requests aborted (a client gave up) per second
    # The share of the window's finished requests (with 2+ output tokens) sent as "flex";
    # None where the pods do not label TPOT by tier, or none finished.
    flex_share: float | None = None
    generation_tokens_per_s: float | None = None  # output tokens/s: the throughput guard
    # Requests running (summed over pods) at each pod's emptiest sample of the window: 0
    # means load began or paused inside it, so the window is not one of steady load.
    running_min: float | None = None
    num_waiting: float | None = None
    num_running: float | None = None
    # The busiest pod's running count (window mean): each pod has its own queue and its own
    # max_num_seqs, so a backlog on one pod binds its cap while a new pod beside it idles.
    running_busiest_pod: float | None = None
    num_waiting_now: float | None = None  # at the window's end (the backlog a plan must also drain)
    prompt_tokens_per_s: float | None = None  # prompt tokens of finished requests per second
    tpot_mean_s: float | None = None  # mean over the window's finished requests of each one's TPOT
    request_rate_per_s: float | None = None
    request_latency_mean_s: float | None = None  # mean end-to-end latency of the finished requests
    request_len_p99: float | None = None  # prompt + generation tokens
    # Mean prompt and generation tokens of the window's finished requests.
    prompt_len_mean: float | None = None
    generation_len_mean: float | None = None
    prefix_hit_rate: float | None = None  # 0..1
    length_refusals_per_s: float | None = None
    # The pods' own KV sizing (kvpilot:kv_cache_bytes, kvpilot:kv_cache_bytes_per_token): the
    # smallest cache and the largest per-token cost over the pods, for the capacity plan.
    kv_cache_bytes: float | None = None
    kv_bytes_per_token: float | None = None
    # The cache's element size (kvpilot:kv_cache_element_bytes: 4, 2, or 1 for fp8) and the
    # weights' bytes (kvpilot:model_weight_bytes, quantized where the pods quantize), largest
    # over the pods: what an fp8 cache would give, and what the weights leave the cache.
    kv_cache_element_bytes: float | None = None
    weight_bytes: float | None = None
    # Speculative decoding (vllm:spec_decode_*), None where the pods do not speculate or drafted
    # nothing in the window: accepted / drafted tokens (0..1); 1 + accepted tokens per draft (the
    # tokens one verification yields); drafts per second; the largest num_speculative_tokens in
    # effect over the pods (kvpilot:num_speculative_tokens; 0 is off).
    spec_acceptance_rate: float | None = None
    spec_mean_accepted_len: float | None = None
    spec_drafts_per_s: float | None = None
    num_speculative_tokens: float | None = None
    pods: tuple[PodSettings, ...] = ()
    missing: tuple[str, ...] = ()
    stale: tuple[str, ...] = ()

    @property
    def preemptions_per_request(self) -> float:
        """Preemptions per finished request; inf when preempting while nothing finishes."""
        if self.request_rate_per_s and self.request_rate_per_s > 0:
            return (self.preemptions_per_s or 0.0) / self.request_rate_per_s
        return math.inf if self.preemptions_per_s else 0.0

    def no_data_reason(self) -> str | None:
        """Why this snapshot cannot support a decision, or None when it can."""
        missing = [s for s in REQUIRED_SIGNALS if s in self.missing]
        stale = [s for s in REQUIRED_SIGNALS if s in self.stale]
        parts = []
        if missing:
            parts.append("no series for " + ", ".join(missing))
        if stale:
            parts.append("stale samples for " + ", ".join(stale))
        # A present signal must have a value, except the latency quantile, which is
        # legitimately empty when no request finished in the window.
        empty = [s for s in REQUIRED_SIGNALS
                 if s not in self.missing and s != "queue_time_p95_s" and getattr(self, s) is None]
        if empty:
            parts.append("no value for " + ", ".join(empty))
        if not parts:
            return None
        return "; ".join(parts)

    def serving(self, replicas: int) -> int:
        """The pods the running and waiting counts are summed over: those reporting their
        settings (a replica still starting runs nothing), or `replicas` where no pod
        reports them (stock vLLM); 0 at zero replicas."""
        return len(self.pods) or replicas

    def running_per_pod(self, replicas: int) -> float:
        """Sequences running on one serving pod (window mean): what max_num_seqs caps."""
        return (self.num_running or 0.0) / max(self.serving(replicas), 1)

    def batch_width(self, replicas: int) -> float:
        """The busiest serving pod's running count (window mean): the batch max_num_seqs caps
        where it binds, and the width behind TPOT p95; the mean per pod where the busiest is
        not known."""
        mean = self.running_per_pod(replicas)
        return mean if self.running_busiest_pod is None else max(mean, self.running_busiest_pod)

    def backlog_served(self, waiting_exit: float) -> str | None:
        """Why the window's queue is no reason to move capacity or settings for it (None when
        it is): next to nothing (under `waiting_exit`) waits now. Queue p95 (recorded as
        requests leave the queue) and mean waiting still show a backlog already served."""
        now = self.num_waiting_now
        if now is None or now >= waiting_exit:
            return None
        return (f"queue p95 {self.queue_time_p95_s or 0.0:.2f}s and {self.num_waiting or 0.0:.1f} waiting on "
                f"average, but {now:.1f} waiting now: the backlog has been served")

    def reported(self, setting: str) -> set[int]:
        """The distinct values of `setting` the pods report (those that export it)."""
        return {v for p in self.pods if (v := getattr(p, setting)) is not None}
