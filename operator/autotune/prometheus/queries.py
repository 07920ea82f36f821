"""The PromQL that reads one LLMDeployment's (or a fleet's) signals, as text: what the reader
in prometheus.py sends.

Every query selects the deployment's pods by namespace and one pod label (by default
`llmdeployment="<name>"`; both label names are configurable to match the scrape
config's relabelling) and aggregates over the pods:

- KV usage: avg and max of `avg_over_time` / `max_over_time` of vllm:kv_cache_usage_perc;
- preemptions/s: sum of rate(vllm:num_preemptions_total);
- queue time, TTFT and TPOT p95: histogram_quantile over the summed bucket rates (TPOT
  is vllm:request_time_per_output_token_seconds, each request's mean: the quantity a
  TPOT objective and the benchmark's goodput judge). Where the pods also export it by
  OpenAI service tier (kvpilot:request_time_per_output_token_seconds{service_tier}), TPOT
  p95 is read over the tiers other than "flex": batch traffic sent as flex asks for no
  latency, so it must not hold the batch narrow. The flex share of finished requests
  comes from the same histogram's counts;
- TTFT and TPOT p50, p75 and p90 (TPOT over every tier) and the rate of aborted requests
  (vllm:request_success_total{finished_reason="abort"}): the share of requests missing the
  objectives, which says whether a replica can pay for itself (payoff.py);
- output tokens/s: sum of rate(vllm:generation_tokens_total) (the throughput guard);
- running at the emptiest moment: each pod's min_over_time of vllm:num_requests_running,
  summed over pods; 0 says load began or paused within the window;
- waiting / running: the sum over pods of each pod's mean over the window;
- the deployment model's inputs (planner.py): the queue at the window's end, prompt
  tokens/s (rate of vllm:prompt_tokens_total) and the mean per-request TPOT (rate of the
  TPOT histogram's _sum over its _count);
- request rate: sum of rate(vllm:e2e_request_latency_seconds_count) (finished requests),
  and their mean latency (rate of the _sum over rate of the _count);
- request length p99 (prompt + generation): the sum of the 99.5th percentiles of the
  prompt and the generation token histograms. The histograms are separate, so the p99
  of the sum cannot be read; but P(prompt + gen > a + b) <= P(prompt > a) + P(gen > b)
  = 0.005 + 0.005, so the sum of the two p99.5s is at least the p99 of the total: a
  conservative (never too short) length. Quantiles within a bucket are interpolated,
  which the 1-2-5 token buckets make coarse; the headroom factor covers that;
- mean prompt and generation lengths: each token histogram's rate(_sum) / rate(_count)
  (for the deployment model: how many requests start per second, how many sequences the
  cache fits);
- prefix-cache hit rate: rate of hits / rate of queries (None with no queries);
- length refusals/s: a configurable expression; vLLM exports no such counter, so when
  its series is absent the signal is None (the raise-on-refusal rule stays off);
- KV sizing: the smallest kvpilot:kv_cache_bytes and the largest
  kvpilot:kv_cache_bytes_per_token over the pods (what the capacity plan needs, for any
  model, without its config), and the largest kvpilot:kv_cache_element_bytes and
  kvpilot:model_weight_bytes (what an fp8 cache would hold; what the weights take);
- speculative decoding (vLLM's counters, present only where the pods speculate): the
  acceptance rate rate(accepted tokens) / rate(draft tokens), the mean accepted length
  1 + rate(accepted tokens) / rate(drafts) (tokens per verification), drafts/s, and the
  largest kvpilot:num_speculative_tokens over the pods; None with no drafts in the window;
- settings in effect: kvpilot:max_num_seqs, kvpilot:max_model_len and
  kvpilot:num_speculative_tokens, per pod.

Staleness: for each raw metric, the oldest pod's newest sample (`min(timestamp(...))`)
is compared with the query's evaluation time; older than `stale_after_scrapes` scrape
intervals means stale. A metric with no series at all is missing. rate() needs two
samples inside the window, so the window should span at least four scrape intervals.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.engine.metrics.buckets import FLEX_TIER, TIER_TPOT_METRIC  # the metric contract

from ..signals import LOWER_QUANTILES


# MetricsSnapshot field -> the raw metric it is computed from (checked for absence and staleness).
SOURCES = {
    "kv_usage_mean": "vllm:kv_cache_usage_perc",
    "kv_usage_max": "vllm:kv_cache_usage_perc",
    "preemptions_per_s": "vllm:num_preemptions_total",
    "queue_time_p95_s": "vllm:request_queue_time_seconds_bucket",
    "ttft_p95_s": "vllm:time_to_first_token_seconds_bucket",
    "tpot_p95_s": "vllm:request_time_per_output_token_seconds_bucket",
    **{f"{k}_p{q}_s": f"{h}_bucket" for k, h in (("ttft", "vllm:time_to_first_token_seconds"),
                                                 ("tpot", "vllm:request_time_per_output_token_seconds"))
       for q in LOWER_QUANTILES},
    "aborted_per_s": "vllm:request_success_total",
    "generation_tokens_per_s": "vllm:generation_tokens_total",
    "running_min": "vllm:num_requests_running",
    "num_waiting": "vllm:num_requests_waiting",
    "num_running": "vllm:num_requests_running",
    "running_busiest_pod": "vllm:num_requests_running",
    "request_rate_per_s": "vllm:e2e_request_latency_seconds_count",
    "request_latency_mean_s": "vllm:e2e_request_latency_seconds_count",
    "request_len_p99": "vllm:request_prompt_tokens_bucket",
    "prompt_len_mean": "vllm:request_prompt_tokens_count",
    "generation_len_mean": "vllm:request_generation_tokens_count",
    "prefix_hit_rate": "vllm:prefix_cache_queries_total",
    "kv_cache_bytes": "kvpilot:kv_cache_bytes",
    "kv_bytes_per_token": "kvpilot:kv_cache_bytes_per_token",
    "kv_cache_element_bytes": "kvpilot:kv_cache_element_bytes",
    "weight_bytes": "kvpilot:model_weight_bytes",
    "num_waiting_now": "vllm:num_requests_waiting",
    "prompt_tokens_per_s": "vllm:prompt_tokens_total",
    "tpot_mean_s": "vllm:request_time_per_output_token_seconds_count",
    "flex_share": f"{TIER_TPOT_METRIC}_count",
    "spec_acceptance_rate": "vllm:spec_decode_num_draft_tokens_total",
    "spec_mean_accepted_len": "vllm:spec_decode_num_drafts_total",
    "spec_drafts_per_s": "vllm:spec_decode_num_drafts_total",
    "num_speculative_tokens": "kvpilot:num_speculative_tokens",
}
# Second sources of two-metric signals (also checked).
EXTRA_SOURCES = {"request_len_p99": "vllm:request_generation_tokens_bucket",
                 "prefix_hit_rate": "vllm:prefix_cache_hits_total",
                 "spec_mean_accepted_len": "vllm:spec_decode_num_accepted_tokens_total"}
SETTINGS_METRICS = {"max_num_seqs": "kvpilot:max_num_seqs", "max_model_len": "kvpilot:max_model_len",
                    "num_speculative_tokens": "kvpilot:num_speculative_tokens"}
# Not a MetricsSnapshot field: TPOT p95 over the tiers other than flex, which replaces tpot_p95_s
# where the pods export TPOT by tier.
TIERED_TPOT_P95 = "tiered_tpot_p95_s"
# Not MetricsSnapshot fields either: kvpilot's engines count requests preempted back into the
# queue apart from vllm:num_requests_waiting (which stays within --max-queued-requests), where
# vLLM counts them in it; added to num_waiting and num_waiting_now where the pods export them.
PREEMPTED_WAITING = {"num_waiting": "preempted_waiting", "num_waiting_now": "preempted_waiting_now"}
DEFAULT_REFUSAL_METRIC = "kvpilot:request_length_refusals_total"


def duration(seconds: float) -> str:
    """A PromQL range duration ("300s")."""
    return f"{max(1, int(round(seconds)))}s"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


@dataclass(frozen=True)
class Target:
    """Which series belong to the deployment."""

    namespace: str
    name: str
    label: str = "llmdeployment"  # the pod label (as relabelled onto the series) naming it
    namespace_label: str = "namespace"
    pod_label: str = "pod"

    @property
    def selector(self) -> str:
        return f'{self.namespace_label}="{_escape(self.namespace)}",{self.label}="{_escape(self.name)}"'

    @property
    def grouping(self) -> tuple[str, ...]:
        """Labels the aggregations keep: none, the selector picks one deployment."""
        return ()


@dataclass(frozen=True)
class FleetTarget:
    """Every deployment's series at once: the same aggregations kept apart by
    (namespace, deployment label), so one query answers for the whole fleet."""

    label: str = "llmdeployment"
    namespace_label: str = "namespace"
    pod_label: str = "pod"

    @property
    def selector(self) -> str:
        return f'{self.label}!=""'

    @property
    def grouping(self) -> tuple[str, ...]:
        return (self.namespace_label, self.label)


def _aggregate(op: str, grouping: tuple[str, ...], extra: tuple[str, ...] = ()) -> str:
    """`sum` or `sum by (le, namespace, llmdeployment) ` (the argument follows in parentheses)."""
    labels = extra + grouping
    return f"{op} by ({', '.join(labels)}) " if labels else op


def build_queries(target: Target | FleetTarget, window_s: float,
                  refusal_metric: str = DEFAULT_REFUSAL_METRIC) -> dict[str, str]:
    """MetricsSnapshot field -> PromQL (instant queries evaluated at the window's end). A
    FleetTarget gives the same expressions grouped by deployment."""
    sel, w, by = target.selector, duration(window_s), target.grouping
    sum_, avg, max_, min_ = (_aggregate(op, by) for op in ("sum", "avg", "max", "min"))

    def rate(metric: str) -> str:
        return f"{sum_}(rate({metric}{{{sel}}}[{w}]))"

    def quantile(q: float, hist: str, extra: str = "") -> str:
        return f"histogram_quantile({q}, {_aggregate('sum', by, ('le',))}(rate({hist}_bucket{{{sel}{extra}}}[{w}])))"

    return {
        "kv_usage_mean": f"{avg}(avg_over_time(vllm:kv_cache_usage_perc{{{sel}}}[{w}]))",
        "kv_usage_max": f"{max_}(max_over_time(vllm:kv_cache_usage_perc{{{sel}}}[{w}]))",
        "preemptions_per_s": rate("vllm:num_preemptions_total"),
        "queue_time_p95_s": quantile(0.95, "vllm:request_queue_time_seconds"),
        "ttft_p95_s": quantile(0.95, "vllm:time_to_first_token_seconds"),
        "tpot_p95_s": quantile(0.95, "vllm:request_time_per_output_token_seconds"),
        **{f"ttft_p{q}_s": quantile(q / 100, "vllm:time_to_first_token_seconds") for q in LOWER_QUANTILES},
        **{f"tpot_p{q}_s": quantile(q / 100, "vllm:request_time_per_output_token_seconds") for q in LOWER_QUANTILES},
        "aborted_per_s": f'{sum_}(rate(vllm:request_success_total{{{sel},finished_reason="abort"}}[{w}]))',
        "generation_tokens_per_s": rate("vllm:generation_tokens_total"),
        "running_min": f"{sum_}(min_over_time(vllm:num_requests_running{{{sel}}}[{w}]))",
        "num_waiting": f"{sum_}(avg_over_time(vllm:num_requests_waiting{{{sel}}}[{w}]))",
        "num_running": f"{sum_}(avg_over_time(vllm:num_requests_running{{{sel}}}[{w}]))",
        "running_busiest_pod": f"{max_}(avg_over_time(vllm:num_requests_running{{{sel}}}[{w}]))",
        "request_rate_per_s": rate("vllm:e2e_request_latency_seconds_count"),
        "request_latency_mean_s": (f"{rate('vllm:e2e_request_latency_seconds_sum')} / "
                                   f"{rate('vllm:e2e_request_latency_seconds_count')}"),
        "request_len_p99": (f"{quantile(0.995, 'vllm:request_prompt_tokens')}"
                            f" + {quantile(0.995, 'vllm:request_generation_tokens')}"),
        "prompt_len_mean": f"{rate('vllm:request_prompt_tokens_sum')} / {rate('vllm:request_prompt_tokens_count')}",
        "generation_len_mean": (f"{rate('vllm:request_generation_tokens_sum')} / "
                                f"{rate('vllm:request_generation_tokens_count')}"),
        "prefix_hit_rate": f"{rate('vllm:prefix_cache_hits_total')} / {rate('vllm:prefix_cache_queries_total')}",
        "length_refusals_per_s": rate(refusal_metric),
        "kv_cache_bytes": f"{min_}(kvpilot:kv_cache_bytes{{{sel}}})",
        "kv_bytes_per_token": f"{max_}(kvpilot:kv_cache_bytes_per_token{{{sel}}})",
        "kv_cache_element_bytes": f"{max_}(kvpilot:kv_cache_element_bytes{{{sel}}})",
        "weight_bytes": f"{max_}(kvpilot:model_weight_bytes{{{sel}}})",
        "num_waiting_now": f"{sum_}(vllm:num_requests_waiting{{{sel}}})",
        PREEMPTED_WAITING["num_waiting"]: f"{sum_}(avg_over_time(kvpilot:num_requests_preempted{{{sel}}}[{w}]))",
        PREEMPTED_WAITING["num_waiting_now"]: f"{sum_}(kvpilot:num_requests_preempted{{{sel}}})",
        "prompt_tokens_per_s": rate("vllm:prompt_tokens_total"),
        "tpot_mean_s": (f"{rate('vllm:request_time_per_output_token_seconds_sum')} / "
                        f"{rate('vllm:request_time_per_output_token_seconds_count')}"),
        "flex_share": (f'{sum_}(rate({TIER_TPOT_METRIC}_count{{{sel},service_tier="{FLEX_TIER}"}}[{w}])) / '
                       f"{rate(TIER_TPOT_METRIC + '_count')}"),
        TIERED_TPOT_P95: quantile(0.95, TIER_TPOT_METRIC, f',service_tier!="{FLEX_TIER}"'),
        # No drafts in the window (speculation off, nothing matched) divides 0 by 0: no value.
        "spec_acceptance_rate": (f"{rate('vllm:spec_decode_num_accepted_tokens_total')} / "
                                 f"{rate('vllm:spec_decode_num_draft_tokens_total')}"),
        "spec_mean_accepted_len": (f"1 + {rate('vllm:spec_decode_num_accepted_tokens_total')} / "
                                   f"{rate('vllm:spec_decode_num_drafts_total')}"),
        "spec_drafts_per_s": rate("vllm:spec_decode_num_drafts_total"),
        "num_speculative_tokens": f"{max_}(kvpilot:num_speculative_tokens{{{sel}}})",
    }


def build_freshness_queries(target: Target | FleetTarget,
                            refusal_metric: str = DEFAULT_REFUSAL_METRIC) -> dict[str, str]:
    """Raw metric -> PromQL giving its newest sample's timestamp over the deployment."""
    metrics = sorted(set(SOURCES.values()) | set(EXTRA_SOURCES.values()) | set(SETTINGS_METRICS.values()) | {refusal_metric})
    min_ = _aggregate("min", target.grouping)
    return {m: f"{min_}(timestamp({m}{{{target.selector}}}))" for m in metrics}


def build_settings_queries(target: Target | FleetTarget) -> dict[str, str]:
    return {k: f"{m}{{{target.selector}}}" for k, m in SETTINGS_METRICS.items()}


def build_idle_queries(target: Target, period_s: float) -> dict[str, str]:
    """IdleReport field -> PromQL over one deployment (scale_to_zero.py)."""
    sel, w = target.selector, duration(period_s)
    return {"requests": f"sum(increase(vllm:e2e_request_latency_seconds_count{{{sel}}}[{w}]))",
            "in_flight": f"sum(vllm:num_requests_running{{{sel}}}) + sum(vllm:num_requests_waiting{{{sel}}})",
            "youngest_pod_s": f"min(time() - process_start_time_seconds{{{sel}}})"}
