"""Reads one LLMDeployment's signals from Prometheus into a Snapshot.

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

import math
from dataclasses import dataclass
from typing import Any, Protocol

from kvpilot.engine.metrics.buckets import FLEX_TIER, TIER_TPOT_METRIC  # the metric contract
from .signals import PodSettings, Snapshot


class QueryClient(Protocol):
    """The one method used of prometheus_api_client.PrometheusConnect."""

    def custom_query(self, query: str, params: dict | None = None) -> list[dict[str, Any]]: ...


# Snapshot field -> the raw metric it is computed from (checked for absence and staleness).
SOURCES = {
    "kv_usage_mean": "vllm:kv_cache_usage_perc",
    "kv_usage_max": "vllm:kv_cache_usage_perc",
    "preemptions_per_s": "vllm:num_preemptions_total",
    "queue_time_p95_s": "vllm:request_queue_time_seconds_bucket",
    "ttft_p95_s": "vllm:time_to_first_token_seconds_bucket",
    "tpot_p95_s": "vllm:request_time_per_output_token_seconds_bucket",
    "generation_tokens_per_s": "vllm:generation_tokens_total",
    "running_min": "vllm:num_requests_running",
    "num_waiting": "vllm:num_requests_waiting",
    "num_running": "vllm:num_requests_running",
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
# Not a Snapshot field: TPOT p95 over the tiers other than flex, which replaces tpot_p95_s
# where the pods export TPOT by tier.
TIERED_TPOT_P95 = "tiered_tpot_p95_s"
SETTINGS_METRICS = {"max_num_seqs": "kvpilot:max_num_seqs", "max_model_len": "kvpilot:max_model_len",
                    "num_speculative_tokens": "kvpilot:num_speculative_tokens"}
DEFAULT_REFUSAL_METRIC = "kvpilot:request_length_refusals_total"
QUERY_TIMEOUT_S = 10


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
    """Snapshot field -> PromQL (instant queries evaluated at the window's end). A
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
        "generation_tokens_per_s": rate("vllm:generation_tokens_total"),
        "running_min": f"{sum_}(min_over_time(vllm:num_requests_running{{{sel}}}[{w}]))",
        "num_waiting": f"{sum_}(avg_over_time(vllm:num_requests_waiting{{{sel}}}[{w}]))",
        "num_running": f"{sum_}(avg_over_time(vllm:num_requests_running{{{sel}}}[{w}]))",
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


UNREACHABLE = "PrometheusUnreachable"  # no HTTP answer: refused, timed out, name not found
BAD_RESPONSE = "BadResponse"  # an answer that is not query data: HTTP error, not JSON, wrong shape


class MetricsUnavailable(Exception):
    """Prometheus gave nothing a decision may rest on; `reason` is UNREACHABLE or BAD_RESPONSE."""

    def __init__(self, reason: str, url: str, detail: str) -> None:
        super().__init__(f"{'cannot reach' if reason == UNREACHABLE else 'bad answer from'} "
                         f"Prometheus at {url}: {detail}")
        self.reason, self.url, self.detail = reason, url, detail


def _number(text: Any) -> float | None:
    """A sample value as Prometheus writes it ("1.5", "NaN", "+Inf"); None unless finite."""
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"sample value {str(text)[:40]!r} is not a number") from None
    return v if math.isfinite(v) else None


def instant_samples(result: Any) -> list[tuple[dict, float, float | None]]:
    """(labels, evaluation time, finite value or None) of each series of an instant vector;
    ValueError for anything shaped otherwise."""
    if not isinstance(result, list):
        raise ValueError(f"result is a {type(result).__name__}, not a list")
    out = []
    for series in result:
        pair = series.get("value") if isinstance(series, dict) else None
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"series {str(series)[:80]!r} has no [time, value] pair")
        ts = _number(pair[0])
        if ts is None:
            raise ValueError(f"series {str(series)[:80]!r} has no finite time")
        labels = series.get("metric")
        out.append((labels if isinstance(labels, dict) else {}, ts, _number(pair[1])))
    return out


def _value(result: Any) -> tuple[float, float | None] | None:
    """(evaluation time, finite value or None) of a single-sample result, or None when empty."""
    samples = instant_samples(result)
    if not samples:
        return None
    _, ts, value = samples[0]
    return ts, value


def checked_query(client: QueryClient, url: str, q: str, params: dict | None = None) -> list[dict]:
    """One instant query; MetricsUnavailable for anything but a well-formed vector."""
    try:
        result = client.custom_query(q, params=params) if params else client.custom_query(q)
        instant_samples(result)  # the shape, checked once here
    except ValueError as e:  # not JSON (requests' JSONDecodeError is an OSError too)
        raise MetricsUnavailable(BAD_RESPONSE, url, f"{type(e).__name__}: {e}"[:300]) from e
    except OSError as e:  # requests' errors are OSErrors: refused, reset, timed out
        raise MetricsUnavailable(UNREACHABLE, url, f"{type(e).__name__}: {e}"[:300]) from e
    except Exception as e:  # HTTP error status, non-JSON body, wrong shape
        raise MetricsUnavailable(BAD_RESPONSE, url, f"{type(e).__name__}: {e}"[:300]) from e
    return result


def build_idle_queries(target: Target, period_s: float) -> dict[str, str]:
    """IdleReport field -> PromQL over one deployment (scale_to_zero.py)."""
    sel, w = target.selector, duration(period_s)
    return {"requests": f"sum(increase(vllm:e2e_request_latency_seconds_count{{{sel}}}[{w}]))",
            "in_flight": f"sum(vllm:num_requests_running{{{sel}}}) + sum(vllm:num_requests_waiting{{{sel}}})",
            "youngest_pod_s": f"min(time() - process_start_time_seconds{{{sel}}})"}


def read_idle(client: QueryClient, url: str, target: Target, period_s: float):
    from .scale_to_zero import IdleReport

    values = {}
    for field, q in build_idle_queries(target, period_s).items():
        value = _value(checked_query(client, url, q))
        values[field] = value[1] if value is not None else None
    return IdleReport(**values)


class PrometheusReader:
    """Snapshot = reader.snapshot(namespace, name, window_s)."""

    def __init__(self, client: QueryClient, *, url: str = "", scrape_interval_s: float = 15.0, stale_after_scrapes: float = 3.0,
                 label: str = "llmdeployment", namespace_label: str = "namespace", pod_label: str = "pod",
                 refusal_metric: str = DEFAULT_REFUSAL_METRIC) -> None:
        self.client = client
        self.url = url or str(getattr(client, "url", "") or "?")
        self.stale_after_s = scrape_interval_s * stale_after_scrapes
        self.label, self.namespace_label, self.pod_label = label, namespace_label, pod_label
        self.refusal_metric = refusal_metric

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> PrometheusReader:
        from .query_client import connect  # imported where used (it imports this module)

        return cls(connect(url, "deployment"), url=url, **kwargs)

    def target(self, namespace: str, name: str) -> Target:
        return Target(namespace, name, self.label, self.namespace_label, self.pod_label)

    def idle(self, namespace: str, name: str, period_s: float):
        """The IdleReport of the `period_s` seconds ending now."""
        return read_idle(self.client, self.url, self.target(namespace, name), period_s)

    def snapshot(self, namespace: str, name: str, window_s: float, at: float | None = None) -> Snapshot:
        """The deployment's signals over the `window_s` seconds ending at `at` (unix
        seconds; Prometheus's own now when None). Query errors propagate to the caller."""
        target = self.target(namespace, name)
        params = {"time": f"{at:.3f}"} if at is not None else None

        def query(q: str) -> list[dict]:
            return checked_query(self.client, self.url, q, params)

        answers = Answers(
            values={f: _value(query(q)) for f, q in build_queries(target, window_s, self.refusal_metric).items()},
            newest={m: _value(query(q)) for m, q in build_freshness_queries(target, self.refusal_metric).items()},
            settings={k: query(q) for k, q in build_settings_queries(target).items()})
        return assemble_snapshot(answers, window_s, at, stale_after_s=self.stale_after_s,
                                 refusal_metric=self.refusal_metric, pod_label=self.pod_label)


@dataclass
class Answers:
    """One deployment's query answers: (evaluation time, value) or None per Snapshot field
    and per raw metric's newest-sample query, and the settings gauges' series."""

    values: dict[str, tuple[float, float | None] | None]
    newest: dict[str, tuple[float, float | None] | None]
    settings: dict[str, list[dict]]


def assemble_snapshot(answers: Answers, window_s: float, at: float | None, *, stale_after_s: float,
                      refusal_metric: str = DEFAULT_REFUSAL_METRIC, pod_label: str = "pod") -> Snapshot:
    """The Snapshot from the answers, whichever reader asked (one deployment or the fleet)."""
    values: dict[str, float | None] = {}
    eval_times: list[float] = []
    for field, got in answers.values.items():
        if got is None:  # no series: missing (if its metric is absent) or empty rate
            values[field] = None
            continue
        eval_times.append(got[0])
        value = got[1]  # never a decision from a non-number: NaN and Inf read as no value
        values[field] = value if value is not None and math.isfinite(value) else None

    newest: dict[str, float | None] = {}
    for metric, got in answers.newest.items():
        newest[metric] = None if got is None else got[1]
        if got is not None:
            eval_times.append(got[0])
    now = at if at is not None else (max(eval_times) if eval_times else 0.0)

    sources = list(SOURCES.items()) + list(EXTRA_SOURCES.items())
    sources.append(("length_refusals_per_s", refusal_metric))
    missing, stale = [], []
    for field, metric in sources:
        if newest.get(metric) is None:
            missing.append(field)
        elif now - newest[metric] > stale_after_s:
            stale.append(field)
    for field in missing + stale:
        values[field] = None
    tiered = values.pop(TIERED_TPOT_P95, None)
    if "flex_share" not in missing and "tpot_p95_s" not in missing + stale:
        values["tpot_p95_s"] = tiered  # None when only flex requests finished

    pods: dict[str, dict] = {}
    for setting, result in answers.settings.items():
        for labels, _, value in instant_samples(result):
            if value is not None:
                pods.setdefault(str(labels.get(pod_label, "?")), {})[setting] = int(value)

    return Snapshot(
        time=now, window_s=window_s,
        pods=tuple(PodSettings(pod, **s) for pod, s in sorted(pods.items())),
        missing=tuple(sorted(set(missing))), stale=tuple(sorted(set(stale))),
        **values,
    )
