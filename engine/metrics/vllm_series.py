"""The series stock vLLM dashboards read that kvpilot does not export, and why: each belongs
to a feature kvpilot does not have (yet), or has only where configured. Every other vLLM series a dashboard queries,
kvpilot exports with vLLM's name, labels and meaning (tests/engine/metrics/test_metrics_parity.py checks
the names, e2e/test_dashboard_queries.py that the panels show data on the real Prometheus)."""

from __future__ import annotations

NOT_EXPORTED: dict[str, str] = {  # name prefix -> the feature it belongs to
    # Exported by a real engine started with --speculative-config (tests/engine/metrics/test_metrics_parity.py);
    # the simulated accelerator, which the e2e dashboards test runs, does not model speculation.
    "vllm:spec_decode_": "speculative decoding (real engines with --speculative-config only)",
    "vllm:nixl_": "NIXL KV transfer between instances (disaggregated prefill)",
    "vllm:kv_offload_": "KV offload to CPU memory",
    "vllm:simple_kv_offload_": "KV offload to CPU memory",
    "vllm:external_prefix_cache_": "an external KV connector (LMCache)",
    "vllm:num_requests_kv_fetch_by_stage": "an external KV connector (async KV loads)",
    "vllm:mm_cache_": "multimodal inputs",
    "vllm:lora_requests_info": "LoRA adapters",
    "vllm:kv_block_": "vLLM's opt-in KV residency metrics (--kv-cache-metrics)",
    "vllm:sleep_mode_operation_duration_seconds": "sleep mode (kvpilot exports the state: always awake)",
    "vllm:rl_weight_update_operation_duration_seconds": "RL weight updates",
    "vllm:estimated_": "vLLM's opt-in per-GPU FLOP/byte estimates (--enable-mfu-metrics)",
}


def not_exported_reason(metric: str) -> str | None:
    """Why kvpilot does not export `metric` (a series name), or None if it does."""
    return next((why for prefix, why in NOT_EXPORTED.items() if metric.startswith(prefix)), None)
