"""The Prometheus reader against a fake client returning canned PromQL results."""

import math


from kvpilot.operator.autotune import PodSettings, PrometheusReader, MetricsSnapshot, Target, build_queries
from kvpilot.operator.autotune.prometheus.queries import build_freshness_queries, duration

NOW = 1_700_000_000.0
SEL = 'namespace="demo",llmdeployment="tiny"'


def scalar(v, t=NOW):
    return [{"metric": {}, "value": [t, str(v)]}]


class FakePrometheus:
    """Answers by matching a fragment of the query; records every query and its params."""

    def __init__(self, answers: dict, default=None):
        # fragment -> result list; freshness fragments first, then the most specific.
        self.answers = dict(sorted(answers.items(), key=lambda kv: (not kv[0].startswith("min(timestamp("),
                                                                     -len(kv[0]))))
        self.default = default
        self.queries: list[tuple[str, dict | None]] = []

    def custom_query(self, query, params=None):
        self.queries.append((query, params))
        for fragment, result in self.answers.items():
            if fragment in query:
                return result
        return [] if self.default is None else self.default(query)


def healthy_answers(age=5.0):
    fresh = scalar(NOW - age)
    return {
        "min(timestamp(": fresh,
        "avg(avg_over_time(vllm:kv_cache_usage_perc": scalar(0.42),
        "max(max_over_time(vllm:kv_cache_usage_perc": scalar(0.77),
        "rate(vllm:num_preemptions_total": scalar(0.25),
        "vllm:request_queue_time_seconds_bucket": scalar(1.5),
        "vllm:time_to_first_token_seconds_bucket": scalar(0.3),
        "vllm:num_requests_waiting": scalar(3.0),
        "vllm:num_requests_running": scalar(12.0),
        "min_over_time(vllm:num_requests_running": scalar(9.0),
        "vllm:request_time_per_output_token_seconds_bucket": scalar(0.045),
        "vllm:generation_tokens_total": scalar(480.0),
        "rate(vllm:e2e_request_latency_seconds_sum": scalar(2.5),
        "vllm:e2e_request_latency_seconds_count": scalar(4.0),
        "vllm:request_prompt_tokens_bucket": scalar(700.0),
        "vllm:prefix_cache_hits_total": scalar(0.6),
        "kvpilot:request_length_refusals_total": [],  # vLLM has no such counter
        "min(timestamp(kvpilot:request_length_refusals_total": [],
        # A stock vLLM pod: no TPOT by service tier.
        "min(timestamp(kvpilot:request_time_per_output_token_seconds_count": [],
        "kvpilot:max_num_seqs{": [
            {"metric": {"pod": "tiny-a", "__name__": "kvpilot:max_num_seqs"}, "value": [NOW, "64"]},
            {"metric": {"pod": "tiny-b", "__name__": "kvpilot:max_num_seqs"}, "value": [NOW, "48"]},
        ],
        "kvpilot:max_model_len{": [
            {"metric": {"pod": "tiny-a"}, "value": [NOW, "2048"]},
            {"metric": {"pod": "tiny-b"}, "value": [NOW, "2048"]},
        ],
    }


def test_queries_use_the_exact_vllm_metric_names_and_the_selector():
    q = build_queries(Target("demo", "tiny"), 300)
    assert q["kv_usage_mean"] == f"avg(avg_over_time(vllm:kv_cache_usage_perc{{{SEL}}}[300s]))"
    assert q["kv_usage_max"] == f"max(max_over_time(vllm:kv_cache_usage_perc{{{SEL}}}[300s]))"
    assert q["preemptions_per_s"] == f"sum(rate(vllm:num_preemptions_total{{{SEL}}}[300s]))"
    assert q["queue_time_p95_s"] == (
        f"histogram_quantile(0.95, sum by (le) (rate(vllm:request_queue_time_seconds_bucket{{{SEL}}}[300s])))")
    assert q["ttft_p95_s"] == (
        f"histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{{{SEL}}}[300s])))")
    assert q["num_waiting"] == f"sum(avg_over_time(vllm:num_requests_waiting{{{SEL}}}[300s]))"
    assert q["num_running"] == f"sum(avg_over_time(vllm:num_requests_running{{{SEL}}}[300s]))"
    assert q["request_rate_per_s"] == f"sum(rate(vllm:e2e_request_latency_seconds_count{{{SEL}}}[300s]))"
    assert q["tpot_p95_s"] == (f"histogram_quantile(0.95, sum by (le) "
                               f"(rate(vllm:request_time_per_output_token_seconds_bucket{{{SEL}}}[300s])))")
    for q_name, level in (("p50", "0.5"), ("p75", "0.75"), ("p90", "0.9")):  # the payoff rule's quantiles
        assert q[f"ttft_{q_name}_s"] == q["ttft_p95_s"].replace("0.95", level)
        assert q[f"tpot_{q_name}_s"] == q["tpot_p95_s"].replace("0.95", level)
    assert q["aborted_per_s"] == f'sum(rate(vllm:request_success_total{{{SEL},finished_reason="abort"}}[300s]))'
    assert q["generation_tokens_per_s"] == f"sum(rate(vllm:generation_tokens_total{{{SEL}}}[300s]))"
    assert q["request_latency_mean_s"] == (f"sum(rate(vllm:e2e_request_latency_seconds_sum{{{SEL}}}[300s])) / "
                                           f"sum(rate(vllm:e2e_request_latency_seconds_count{{{SEL}}}[300s]))")
    assert q["running_min"] == f"sum(min_over_time(vllm:num_requests_running{{{SEL}}}[300s]))"
    # The busiest pod's mean: each pod queues its own requests behind its own max_num_seqs.
    assert q["running_busiest_pod"] == f"max(avg_over_time(vllm:num_requests_running{{{SEL}}}[300s]))"
    assert "vllm:request_prompt_tokens_bucket{" in q["request_len_p99"]
    assert "vllm:request_generation_tokens_bucket{" in q["request_len_p99"]
    assert q["request_len_p99"].count("histogram_quantile(0.995,") == 2
    assert q["prefix_hit_rate"] == (f"sum(rate(vllm:prefix_cache_hits_total{{{SEL}}}[300s])) / "
                                    f"sum(rate(vllm:prefix_cache_queries_total{{{SEL}}}[300s]))")
    fresh = build_freshness_queries(Target("demo", "tiny"))
    for metric in ("vllm:kv_cache_usage_perc", "vllm:num_preemptions_total", "kvpilot:max_num_seqs",
                   "kvpilot:max_model_len", "vllm:request_generation_tokens_bucket"):
        assert fresh[metric] == f"min(timestamp({metric}{{{SEL}}}))"


def test_label_names_are_configurable_and_values_escaped():
    t = Target("demo", 'we"ird', label="app_kubernetes_io_instance", namespace_label="kubernetes_namespace")
    assert t.selector == 'kubernetes_namespace="demo",app_kubernetes_io_instance="we\\"ird"'
    assert duration(29.6) == "30s" and duration(0.1) == "1s"


def test_snapshot_from_canned_results():
    fake = FakePrometheus(healthy_answers())
    s = PrometheusReader(fake).snapshot("demo", "tiny", 300)
    assert isinstance(s, MetricsSnapshot)
    assert s.time == NOW and s.window_s == 300
    assert (s.kv_usage_mean, s.kv_usage_max) == (0.42, 0.77)
    assert s.preemptions_per_s == 0.25 and s.queue_time_p95_s == 1.5 and s.ttft_p95_s == 0.3
    assert (s.num_waiting, s.num_running, s.request_rate_per_s) == (3.0, 12.0, 4.0)
    assert s.request_len_p99 == 700.0 and s.prefix_hit_rate == 0.6
    assert (s.tpot_p95_s, s.generation_tokens_per_s, s.running_min) == (0.045, 480.0, 9.0)
    assert s.request_latency_mean_s == 2.5  # the canned answer to the whole sum/count query
    assert s.length_refusals_per_s is None and s.missing == ("flex_share", "length_refusals_per_s")
    assert s.stale == ()
    assert s.pods == (PodSettings("tiny-a", 64, 2048), PodSettings("tiny-b", 48, 2048))
    assert s.no_data_reason() is None
    every = " ".join(q for q, _ in fake.queries)
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_preemptions_total", "vllm:request_queue_time_seconds_bucket",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
                 "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                 "vllm:e2e_request_latency_seconds_count", "kvpilot:max_num_seqs", "kvpilot:max_model_len"):
        assert name in every
    assert all(SEL in q for q, _ in fake.queries)


def test_tpot_p95_leaves_out_flex_requests_where_pods_label_the_tier():
    q = build_queries(Target("demo", "tiny"), 60)
    assert q["flex_share"] == (
        f'sum(rate(kvpilot:request_time_per_output_token_seconds_count{{{SEL},service_tier="flex"}}[60s])) / '
        f"sum(rate(kvpilot:request_time_per_output_token_seconds_count{{{SEL}}}[60s]))")
    assert 'kvpilot:request_time_per_output_token_seconds_bucket{' + SEL + ',service_tier!="flex"}' in (
        q["tiered_tpot_p95_s"])
    answers = healthy_answers()
    del answers["min(timestamp(kvpilot:request_time_per_output_token_seconds_count"]
    answers['service_tier="flex"'] = scalar(0.25)
    answers['service_tier!="flex"'] = scalar(0.031)
    s = PrometheusReader(FakePrometheus(answers)).snapshot("demo", "tiny", 60)
    assert s.flex_share == 0.25 and s.tpot_p95_s == 0.031  # not vLLM's 0.045 over every request
    # Only flex requests finished: no TPOT for an objective to judge, not missing data.
    answers['service_tier!="flex"'] = scalar("NaN")
    answers['service_tier="flex"'] = scalar(1.0)
    s = PrometheusReader(FakePrometheus(answers)).snapshot("demo", "tiny", 60)
    assert s.flex_share == 1.0 and s.tpot_p95_s is None and s.no_data_reason() is None


def test_mean_lengths_come_from_the_token_histograms():
    q = build_queries(Target("demo", "tiny"), 60)
    assert q["prompt_len_mean"] == (f"sum(rate(vllm:request_prompt_tokens_sum{{{SEL}}}[60s])) / "
                                    f"sum(rate(vllm:request_prompt_tokens_count{{{SEL}}}[60s]))")
    assert q["generation_len_mean"].startswith("sum(rate(vllm:request_generation_tokens_sum{")


def test_evaluation_time_is_passed_when_given():
    fake = FakePrometheus(healthy_answers())
    s = PrometheusReader(fake).snapshot("demo", "tiny", 60, at=NOW)
    assert s.time == NOW
    assert all(p == {"time": f"{NOW:.3f}"} for _, p in fake.queries)


def test_nan_quantiles_are_empty_not_missing():
    answers = healthy_answers()
    answers["vllm:request_queue_time_seconds_bucket"] = scalar("NaN")
    answers["vllm:prefix_cache_hits_total"] = scalar("NaN")
    s = PrometheusReader(FakePrometheus(answers)).snapshot("demo", "tiny", 60)
    assert s.queue_time_p95_s is None and s.prefix_hit_rate is None
    assert "queue_time_p95_s" not in s.missing and s.no_data_reason() is None


def test_absent_metrics_are_missing_and_mean_no_data():
    answers = healthy_answers()
    answers["min(timestamp(vllm:kv_cache_usage_perc"] = []
    answers["avg(avg_over_time(vllm:kv_cache_usage_perc"] = []
    answers["max(max_over_time(vllm:kv_cache_usage_perc"] = []
    s = PrometheusReader(FakePrometheus(answers)).snapshot("demo", "tiny", 60)
    assert {"kv_usage_mean", "kv_usage_max"} <= set(s.missing)
    assert "no series for kv_usage_mean" in s.no_data_reason()


def test_nothing_at_all_is_no_data():
    s = PrometheusReader(FakePrometheus({})).snapshot("demo", "tiny", 60)
    assert s.pods == () and s.no_data_reason().startswith("no series for")


def test_old_samples_are_stale():
    fake = FakePrometheus(healthy_answers(age=61.0))
    s = PrometheusReader(fake, scrape_interval_s=10, stale_after_scrapes=6).snapshot("demo", "tiny", 60)
    assert "kv_usage_mean" in s.stale and s.kv_usage_mean is None
    assert "stale samples" in s.no_data_reason()
    ok = PrometheusReader(FakePrometheus(healthy_answers(age=59.0)), scrape_interval_s=10,
                          stale_after_scrapes=6).snapshot("demo", "tiny", 60)
    assert ok.stale == ()


def test_a_counter_without_a_rate_yet_is_no_value():
    answers = healthy_answers()
    answers["rate(vllm:num_preemptions_total"] = []  # one sample in the window: rate() is empty
    s = PrometheusReader(FakePrometheus(answers)).snapshot("demo", "tiny", 60)
    assert s.preemptions_per_s is None and "preemptions_per_s" not in s.missing
    assert "no value for preemptions_per_s" in s.no_data_reason()


def test_refusal_metric_is_configurable():
    answers = healthy_answers()
    answers["my_refusals_total"] = scalar(0.5)
    fake = FakePrometheus(answers)
    s = PrometheusReader(fake, refusal_metric="my_refusals_total").snapshot("demo", "tiny", 60)
    assert s.length_refusals_per_s == 0.5 and "length_refusals_per_s" not in s.missing


def test_from_url_builds_a_prometheus_connect():
    from prometheus_api_client import PrometheusConnect

    reader = PrometheusReader.from_url("http://127.0.0.1:9", scrape_interval_s=5)
    assert isinstance(reader.client.inner, PrometheusConnect)  # counted: kvpilot_operator_prometheus_queries
    assert reader.client.url == reader.url == "http://127.0.0.1:9"
    assert math.isclose(reader.stale_after_s, 15.0)


def test_requests_preempted_back_into_the_queue_count_as_waiting():
    """kvpilot's engines export them apart (kvpilot:num_requests_preempted), so that
    vllm:num_requests_waiting stays within the queue cap; vLLM counts them in its gauge.
    Either way the autotuner reads everything that waits."""
    kvpilot = FakePrometheus({**healthy_answers(), "kvpilot:num_requests_preempted": scalar(2.0)})
    s = PrometheusReader(kvpilot).snapshot("demo", "tiny", 300)
    assert (s.num_waiting, s.num_waiting_now) == (5.0, 5.0)
    stock = PrometheusReader(FakePrometheus(healthy_answers())).snapshot("demo", "tiny", 300)
    assert (stock.num_waiting, stock.num_waiting_now) == (3.0, 3.0)
    assert "num_waiting" not in stock.missing
