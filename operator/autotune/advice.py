"""Advice the autotuner gives but never applies: settings that need the pods restarted, and a
warning when a prefix the prompts share does not hit the cache.

The field guide's remedies for a KV cache pinned near full are a smaller cache footprint
per token (quantize the cache) or a shorter maximum length. The autotuner moves
max_model_len itself (KVCacheBound); an fp8 cache (spec.engine.kvCacheDtype: fp8) halves a
16-bit cache's bytes per token, but it restarts every pod and changes the numbers the
model computes (docs/quantization.md, "The fp8 KV cache": most greedy tokens agree, not all), so it is a
recommendation in status.autotune.advice, with the capacity it would give, for a person to
weigh. A pure function of the diagnosis, the snapshot, the capacity plan and the spec.
"""

from __future__ import annotations

from dataclasses import dataclass

from .capacity import CapacityPlan
from .decision import DEFAULT_THRESHOLDS, Diagnosis, Thresholds
from .signals import MetricsSnapshot

# Diagnoses in which the cache's size is what binds: preempting for room, queueing with the
# cache full (KVCacheBound), or no tuning headroom left while the cache is full and the
# capacity plan says it (not max_num_seqs) is the limit.
CACHE_BOUND = (Diagnosis.PREEMPTION_BOUND, Diagnosis.KV_CACHE_BOUND, Diagnosis.HARDWARE_BOUND)
FP8_NAMES = ("fp8", "fp8_e4m3")


@dataclass(frozen=True)
class Advice:
    setting: str  # the spec field, e.g. "engine.kvCacheDtype"
    value: str
    reason: str


def restart_advice(diagnosis: Diagnosis, snapshot: MetricsSnapshot | None, capacity: CapacityPlan | None, *,
                   kv_cache_dtype: str | None, simulated: bool,
                   thresholds: Thresholds = Thresholds()) -> list[Advice]:
    """What to change in the spec that the autotuner may not change live (empty: nothing)."""
    if diagnosis not in CACHE_BOUND or snapshot is None or simulated or kv_cache_dtype in FP8_NAMES:
        return []  # the simulated accelerator models float caches only (the spec refuses fp8 there)
    element = snapshot.kv_cache_element_bytes
    if not element or element <= 1:
        return []  # unknown (stock vLLM pods), or the cache is already 8-bit
    if diagnosis is Diagnosis.HARDWARE_BOUND and (
            capacity is None or capacity.bound != "HardwareBound"
            or (snapshot.kv_usage_mean or 0.0) < thresholds.kv_full_exit):
        return []  # queueing, but the cache is not what binds: fp8 would not help
    factor = int(element)
    if capacity is not None and capacity.fp8_max_concurrent_seqs is not None:
        gain = (f"the cache holds {capacity.max_concurrent_seqs} sequences of {capacity.seq_len} tokens "
                f"at {capacity.bytes_per_token} bytes/token; fp8 would hold {capacity.fp8_max_concurrent_seqs} "
                f"({capacity.bytes_per_token // factor} bytes/token)")
    else:
        gain = f"fp8 holds {factor}x the tokens of the current {factor}-byte cache in the same memory"
    reason = (f"{diagnosis.value}: the KV cache's size binds; {gain}. Needs a restart of every pod, so "
              f"it is advised, not applied; check the deployment's quality with fp8 first (e4m3 "
              f"rounding changes some greedy tokens)")
    return [Advice("engine.kvCacheDtype", "fp8", reason)]


def prefix_cache_warning(snapshot: MetricsSnapshot, shared_prefix: bool,
                         thresholds: Thresholds = DEFAULT_THRESHOLDS) -> str | None:
    """A warning (for a condition and an Event; never an action) when prompts are known to
    share a prefix (`shared_prefix`, e.g. a system prompt) yet the cache rarely hits: the
    usual cause is per-request content (a timestamp, a user name) at the head of the
    prompt, after which every token misses."""
    rate = snapshot.prefix_hit_rate
    if not shared_prefix or rate is None or rate >= thresholds.prefix_hit_low:
        return None
    if (snapshot.request_rate_per_s or 0.0) < thresholds.idle_rate_per_s:
        return None
    return (f"prefix-cache hit rate {rate:.0%} (< {thresholds.prefix_hit_low:.0%}) although prompts share "
            f"a prefix: something that changes per request near the start of the prompt defeats the cache; "
            f"move it after the shared part")
