"""vLLM metric parity (issue 17, item 1): the series the stock vLLM dashboards read exist on
kvpilot's /metrics, and the ones kvpilot added hold vLLM's quantities."""

from __future__ import annotations

import glob
import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.config.engine import EngineConfig
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.core.sampling_params import SamplingParams
from kvpilot.engine.metrics.exporter import ServerMetrics
from kvpilot.engine.metrics.vllm_series import not_exported_reason
from server_harness import fail_preparing_requests

DASHBOARDS = Path(__file__).resolve().parents[3].parent / "shared" / "reference" / "vllm-dashboards"

SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def dashboard_metrics() -> set[str]:
    """Every metric name in the stock dashboards' queries, as exported (counters with _total);
    one ending in "_" is a prefix a regex matcher there completes."""
    names = set()
    for path in glob.glob(str(DASHBOARDS / "*.json")):
        text = json.dumps(json.load(open(path)))
        names |= set(re.findall(r"\b((?:vllm:|http_|process_)[a-z0-9_]+)", text))
    return names


def exported_names(text: str) -> set[str]:
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def engine_with_metrics():
    engine = LLMEngine(EngineConfig(model="builtin:tiny", kv_cache_memory="16Mi", max_model_len=512))
    metrics = ServerMetrics("tiny", engine.max_model_len_ceiling)
    engine.latency_sink = metrics
    prompt = list(range(10, 60))  # 50 tokens: three full blocks a second request can share
    engine.add_request("a", prompt, SamplingParams(n=2, max_tokens=5, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        steps.append(len(engine.step()))
        metrics.record_stats(engine.stats())
    engine.add_request("b", prompt + [7, 8], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("c", [5, 6, 7], SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        metrics.record_stats(engine.stats())
    samples = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            samples[(s.name, tuple(sorted(labels.items())))] = s.value
    return engine, samples


def value(samples, name, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_prompt_tokens_by_source_add_up_and_name_the_cache_hits(engine_with_metrics):
    engine, m = engine_with_metrics
    total = value(m, "vllm:prompt_tokens_total")
    computed = value(m, "vllm:prompt_tokens_by_source_total", source="local_compute")
    cached = value(m, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
    assert total == 50 * 2 + 52 + 3  # each choice's prompt counts, as in vLLM
    assert cached > 0 and computed + cached == total
    assert value(m, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert value(m, "vllm:prompt_tokens_cached_total") == cached
    assert value(m, "vllm:prompt_tokens_cached_by_source_total", source="device") == \
        value(m, "vllm:prefix_cache_hits_total")
    assert value(m, "vllm:request_prefill_kv_computed_tokens_sum") == computed


def test_iteration_tokens_are_computed_prompt_plus_generated_per_step(engine_with_metrics):
    _, m = engine_with_metrics
    assert value(m, "vllm:iteration_tokens_total_sum") == (
        value(m, "vllm:prompt_tokens_by_source_total", source="local_compute")
        + value(m, "vllm:generation_tokens_total"))
    assert value(m, "vllm:iteration_tokens_total_count") >= 5  # a's five decode steps at least


def test_request_parameters_once_per_request_and_per_choice(engine_with_metrics):
    _, m = engine_with_metrics
    assert value(m, "vllm:request_params_n_count") == 3  # a, b, c
    assert value(m, "vllm:request_params_n_sum") == 2 + 1 + 1
    assert value(m, "vllm:request_max_num_generation_tokens_sum") == 5 + 3 + 1
    assert value(m, "vllm:request_params_max_tokens_count") == 4  # per choice, as vLLM's finished requests
    assert value(m, "vllm:request_params_max_tokens_sum") == 5 + 5 + 3 + 1


def test_phase_times_preemptions_and_vllms_zero_tpot(engine_with_metrics):
    _, m = engine_with_metrics
    for phase in ("prefill", "decode", "inference"):
        assert value(m, f"vllm:request_{phase}_time_seconds_count") == 4
    assert value(m, "vllm:request_inference_time_seconds_sum") >= value(m, "vllm:request_decode_time_seconds_sum")
    assert value(m, "vllm:request_num_preemptions_count") == 4
    assert value(m, "vllm:request_num_preemptions_sum") == 0
    # c made one token: vLLM records a TPOT of 0 for it; kvpilot's per-tier series leaves it out.
    assert value(m, "vllm:request_time_per_output_token_seconds_count") == 4
    assert value(m, "kvpilot:request_time_per_output_token_seconds_count", service_tier="default") == 3


def test_state_gauges_vllm_dashboards_read(engine_with_metrics):
    _, m = engine_with_metrics
    assert value(m, "vllm:num_requests_waiting_by_reason", reason="capacity") == value(m, "vllm:num_requests_waiting")
    assert value(m, "vllm:num_requests_waiting_by_reason", reason="deferred") == 0
    assert value(m, "vllm:engine_sleep_state", sleep_state="awake") == 1
    assert value(m, "vllm:engine_sleep_state", sleep_state="discard_all") == 0
    for reason in ("stop", "length", "abort", "error", "repetition"):
        assert ("vllm:request_success_total", (("finished_reason", reason),)) in m


def test_token_buckets_reach_the_largest_max_model_len_a_live_change_can_set(engine_with_metrics):
    engine, m = engine_with_metrics
    les = [float(dict(k[1])["le"]) for k in m if k[0] == "vllm:request_prompt_tokens_bucket"]
    assert engine.max_model_len == 512 and engine.max_model_len_ceiling > 512
    assert max(le for le in les if le != float("inf")) > 512


def test_a_request_the_engine_fails_on_counts_as_error(monkeypatch):
    engine = LLMEngine(EngineConfig(model="builtin:tiny", kv_cache_memory="16Mi", max_model_len=512))
    metrics = ServerMetrics("tiny", engine.max_model_len_ceiling)
    engine.latency_sink = metrics
    fail_preparing_requests(monkeypatch, "poison")
    engine.add_request("good", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request("poison", [1, 2, 3], SamplingParams(n=2, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    success = {s.labels["finished_reason"]: s.value
               for family in text_string_to_metric_families(metrics.render().decode())
               for s in family.samples if s.name == "vllm:request_success_total"}
    assert success["error"] == 2  # both choices of the failed request
    assert success["length"] == 1 and success["abort"] == 0


@pytest.mark.skipif(not DASHBOARDS.is_dir(), reason="the vLLM dashboards (shared/reference) are not here")
def test_every_dashboard_series_for_kvpilots_features_is_exported():
    """A live in-process server with a request behind it: every metric the stock vLLM
    dashboards query exists on /metrics, except those of features kvpilot lacks (named)."""
    from test_server_hardening import InProcessServer

    wanted = {n for n in dashboard_metrics() if not_exported_reason(n) is None}
    with InProcessServer(model="builtin:tiny", kv_cache_memory="16Mi", max_model_len=512,
                         max_num_seqs=4) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200, r.text
        names = exported_names(httpx.get(srv.url + "/metrics", timeout=10).text)
    family = {n for name in names for n in (name, *(name[:-len(s)] for s in SUFFIXES if name.endswith(s)))}
    missing = sorted(n for n in wanted if n not in family
                     and not (n.endswith("_") and any(f.startswith(n) for f in family)))
    assert not missing, f"series the stock dashboards read that kvpilot does not export: {missing}"
    assert len(wanted) >= 40  # the fixture really was read


@pytest.mark.skipif(not DASHBOARDS.is_dir(), reason="the vLLM dashboards (shared/reference) are not here")
def test_a_speculating_server_exports_every_spec_decode_series_the_dashboards_read():
    from test_server_hardening import InProcessServer

    wanted = {n for n in dashboard_metrics() if n.startswith("vllm:spec_decode_")}
    with InProcessServer(model="builtin:tiny", kv_cache_memory="16Mi", max_model_len=512, max_num_seqs=4,
                         speculative_config='{"method": "ngram", "num_speculative_tokens": 2}') as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi hi hi hi", "max_tokens": 8}, timeout=60)
        assert r.status_code == 200, r.text
        names = exported_names(httpx.get(srv.url + "/metrics", timeout=10).text)
    family = {n for name in names for n in (name, *(name[:-len(s)] for s in SUFFIXES if name.endswith(s)))}
    assert len(wanted) >= 4 and wanted <= family, sorted(wanted - family)
