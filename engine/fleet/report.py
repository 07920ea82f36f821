"""The simulator's figures, in `kvpilot bench serve`'s shape (same keys, same printout)
plus what only a simulator sees cheaply: preemptions, KV usage over time, busy time."""

from __future__ import annotations

import statistics

from ..bench.serve_stats import latency_stats, print_result, throughput_stats
from .fleet import Fleet, SimRequest
from .log_histogram import LogHistogram

SIMULATED = "SIMULATED accelerator"


def meets(r: SimRequest, slos_ms: dict[str, float]) -> bool:
    measured = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2e}
    return r.error is None and all(measured[k] is not None and measured[k] * 1000.0 <= ms
                                   for k, ms in slos_ms.items())


def summarize(fleet: Fleet, goodput: dict[str, float] | None = None) -> dict:
    reqs = fleet.requests
    ok = [r for r in reqs if r.error is None and r.finished is not None]
    start = min((r.arrival for r in reqs), default=0.0)
    end = max((r.finished for r in ok), default=start)
    duration = end - start
    replicas = fleet.replicas + fleet.retired
    runner = replicas[0].engine.runner
    out = {"simulated": True, "accelerator": runner.accelerator.name,
           "tensor_parallel_size": runner.parallel.size,
           **throughput_stats(duration, len(ok), len(reqs) - len(ok), sum(r.prompt_len for r in ok),
                              sum(r.output_tokens for r in ok), {r.error for r in reqs if r.error})}
    latency_stats("ttft", [r.ttft for r in ok if r.ttft is not None], out)
    latency_stats("tpot", [t for t in (r.tpot for r in ok) if t is not None], out)
    latency_stats("e2el", [r.e2e for r in ok], out)
    latency_stats("queue", [r.queue_time for r in ok if r.queue_time is not None], out)
    itl = LogHistogram()
    for rep in replicas:
        rep.metrics.flush()
        itl.merge(rep.metrics.itl_fine)
    out.update(mean_itl_ms=itl.mean * 1000, median_itl_ms=itl.quantile(0.5) * 1000,
               std_itl_ms=itl.std * 1000, p95_itl_ms=itl.quantile(0.95) * 1000,
               p99_itl_ms=itl.quantile(0.99) * 1000)
    out["preemptions"] = sum(r.engine.scheduler.num_preemptions for r in replicas)
    out["requests_preempted"] = sum(1 for r in ok if r.num_preemptions)
    out["busy_fraction"] = (sum(r.engine.runner.busy_s for r in replicas) / (duration * len(replicas))
                            if duration > 0 else 0.0)
    kv = [s.value for sc in fleet.scrapes for s in sc.samples if s.name == "vllm:kv_cache_usage_perc"]
    out["kv_usage_mean"] = statistics.fmean(kv) if kv else None
    out["kv_usage_max"] = max(kv) if kv else None
    out["replicas"] = len(replicas)
    if goodput:
        good = sum(1 for r in ok if meets(r, goodput))
        out["request_goodput"] = good / duration if duration > 0 else 0.0
        out["goodput_slos_ms"] = dict(goodput)
    return out


def print_sim_result(r: dict) -> None:
    tp = r.get("tensor_parallel_size", 1)
    gpus = f" ({tp} GPUs each, tensor_parallel_size {tp})" if tp > 1 else ""
    print(f"{SIMULATED}: {r['accelerator']} x{r['replicas']}{gpus} (figures are modelled, not measured on hardware)")
    print_result(r)
    print(f"{'Preemptions:':<40} {r['preemptions']:<10} ({r['requests_preempted']} requests)")
    if r.get("kv_usage_mean") is not None:
        print(f"{'KV cache usage mean / max:':<40} {r['kv_usage_mean']:.1%} / {r['kv_usage_max']:.1%}")
    print(f"{'Accelerator busy:':<40} {r['busy_fraction']:.1%}")
    print(f"{'Median / P99 queue time (ms):':<40} {r['median_queue_ms']:.2f} / {r['p99_queue_ms']:.2f}")


def scrape_series(fleet: Fleet) -> dict[str, list[tuple[float, float]]]:
    """Fleet-wide series over time from the scrapes: requests running and waiting (sums),
    KV cache usage (mean over replicas) and output tokens/s (rate between scrapes)."""
    by_time: dict[float, list[dict[str, float]]] = {}
    for sc in fleet.scrapes:
        by_time.setdefault(sc.time, []).append({s.name: s.value for s in sc.samples if not s.labels.get("le")})
    out: dict[str, list[tuple[float, float]]] = {"running": [], "waiting": [], "kv_usage_pct": [], "tokens_per_s": []}
    prev = None
    for t in sorted(by_time):
        reps = by_time[t]
        out["running"].append((t, sum(r.get("vllm:num_requests_running", 0.0) for r in reps)))
        # preempted requests wait too (kvpilot's engines count them apart from vLLM's gauge)
        out["waiting"].append((t, sum(r.get("vllm:num_requests_waiting", 0.0) + r.get("kvpilot:num_requests_preempted", 0.0)
                                      for r in reps)))
        out["kv_usage_pct"].append((t, 100 * statistics.fmean(r.get("vllm:kv_cache_usage_perc", 0.0) for r in reps)))
        tokens = sum(r.get("vllm:generation_tokens_total", 0.0) for r in reps)
        if prev is not None and t > prev[0]:
            out["tokens_per_s"].append((t, max(tokens - prev[1], 0.0) / (t - prev[0])))
        prev = (t, tokens)
    return out


def plot_scrapes(fleet: Fleet, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = scrape_series(fleet)
    panels = [("running", "requests running"), ("waiting", "requests waiting"),
              ("kv_usage_pct", "KV cache %"), ("tokens_per_s", "output tokens/s")]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 8), sharex=True)
    for ax, (key, label) in zip(axes, panels):
        pts = series[key]
        ax.plot([t / 60 for t, _ in pts], [v for _, v in pts], lw=1.2)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("simulated minutes")
    fig.suptitle(f"{SIMULATED}: {title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
