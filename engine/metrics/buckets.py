"""vLLM's metric bucket boundaries and label values, shared by the server's Prometheus
collectors and the simulator's scrapes (which must read exactly like a real pod's)."""

from __future__ import annotations

# vLLM's FinishReason values; every series exists from the start, as vLLM's do. "error" is a
# request the engine failed on; kvpilot has no repetition detection, so that one stays 0.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
WAITING_REASONS = ("capacity", "deferred")  # kvpilot defers nothing: all waiting is capacity
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # kvpilot has no sleep mode
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
ENGINE_INDEX = "0"  # vLLM labels every series with the engine core's index
# OpenAI's service tiers as this server keeps them ("auto" is served as "default"). "flex"
# traffic tolerates slow answers: the autotuner holds no latency objective for it.
SERVICE_TIERS = ("default", "flex", "priority")
FLEX_TIER = "flex"
TIER_TPOT_METRIC = "kvpilot:request_time_per_output_token_seconds"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vLLM's boundaries plus finer ones where TPOT objectives live (20-125 ms): the autotuner
# reads TPOT p95 by interpolating inside a bucket, and 25/50/75 ms alone cannot tell 30 ms
# from 49 ms. Every vLLM `le` value is still there, so dashboards keep working.
TOKEN_LATENCY_BUCKETS = (0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.045, 0.05, 0.06,
                         0.075, 0.09, 0.1, 0.125, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                         1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# vLLM's, plus 3.5 and 7.5 s between its 2.5/5/10 s, and 20/50/100/200 ms below its first
# (0.3 s): the autotuner's queue-time p95 must be able to read under its 0.2 s exit level,
# or a queue that has emptied would still read as 0.95 x 0.3 s by interpolation.
REQUEST_LATENCY_BUCKETS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 3.5, 5.0, 7.5, 10.0,
                           15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
# prometheus-fastapi-instrumentator's defaults, as vLLM's server exposes them.
HTTP_DURATION_BUCKETS = (0.1, 0.5, 1.0)


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10

# A simulated executor's cumulative counters (kvpilot:<key>_total).
SIMULATED_COUNTERS = {
    "simulated_steps": "Engine steps run on the simulated accelerator.",
    "simulated_busy_seconds": "Modelled accelerator time spent in steps.",
    "simulated_overrun_seconds": "Host time past the modelled end of steps (the host is too slow "
                                 "for the simulated load when this grows).",
}
