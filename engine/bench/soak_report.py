"""The result of `kvpilot bench soak`: counts by request class, failures by kind, RSS
readings and growth, the gauges at the end, the checks, and the printed block."""

from __future__ import annotations

from collections import Counter, defaultdict

MAX_ERRORS_KEPT = 10
MIB = 2**20


def growth_pct(rss: dict[str, int | None]) -> float | None:
    """RSS growth from the warm-up reading to the end, in percent; None if either is missing."""
    warm, end = rss.get("warmup"), rss.get("end")
    return 100.0 * (end - warm) / warm if warm and end is not None else None


def summarize(cfg, requests, outcomes, *, duration: float, rss: dict, rss_source: str,
              rss_trace: list, gauges: dict, settled_s: float | None, server_aborted: int,
              model: str, base_url: str) -> dict:
    by_class: dict[str, Counter] = defaultdict(Counter)
    failures: Counter[str] = Counter()
    errors: list[str] = []
    for req, out in zip(requests, outcomes):
        by_class[req.kind]["sent"] += 1
        by_class[req.kind][out.status] += 1
        if out.status == "failed":
            failures[out.kind] += 1
            if len(errors) < MAX_ERRORS_KEPT:
                errors.append(f"#{req.index} {req.kind}: {out.kind}: {out.message}")
    totals = Counter(o.status for o in outcomes)
    cancelled = totals["cancelled"]
    growth = growth_pct(rss)
    checks = {
        "no_failures": totals["failed"] == 0,
        "rss_growth": None if growth is None else growth <= cfg.max_rss_growth_pct,
        "gauges_back_to_zero": settled_s is not None,
        # each cancelled request aborts at least one choice in the engine
        "cancels_reached_server": None if not cancelled else server_aborted >= cancelled,
    }
    return {
        "model": model, "base_url": base_url, "num_requests": cfg.num_requests,
        "concurrency": cfg.concurrency, "seed": cfg.seed, "max_tokens": cfg.max_tokens,
        "cancel_fraction": cfg.cancel_fraction, "warmup_requests": cfg.warmup_requests,
        "duration_s": duration, "request_throughput": len(requests) / duration if duration else 0.0,
        "sent": len(requests), "ok": totals["ok"], "failed": totals["failed"], "cancelled": cancelled,
        "cancel_missed": sum(1 for o in outcomes if o.cancel_missed),
        "by_class": {k: dict(v) for k, v in sorted(by_class.items())},
        "failures_by_kind": dict(failures), "errors": errors,
        "server_aborted": server_aborted,
        "rss_bytes": rss, "rss_source": rss_source, "rss_trace": rss_trace,
        "rss_growth_pct": growth, "max_rss_growth_pct": cfg.max_rss_growth_pct,
        "gauges_at_end": gauges, "gauges_settled_s": settled_s,
        "checks": checks, "passed": all(v is not False for v in checks.values()),
    }


def _mib(value: int | None) -> str:
    return f"{value / MIB:.1f}" if value is not None else "n/a"


def _verdict(ok: bool | None) -> str:
    return {True: "pass", False: "FAIL", None: "not measured"}[ok]


def print_result(r: dict) -> None:
    line = "{:<44}{:>20}"
    print("{s:{c}^64}".format(s=" Soak Result ", c="="))
    print(line.format("Requests sent:", r["sent"]))
    print(line.format("Duration (s):", f"{r['duration_s']:.1f}"))
    print(line.format("Request throughput (req/s):", f"{r['request_throughput']:.2f}"))
    print(f"{'class':<24}{'sent':>10}{'ok':>10}{'failed':>10}{'cancelled':>10}")
    for kind, c in r["by_class"].items():
        print(f"{kind:<24}{c.get('sent', 0):>10}{c.get('ok', 0):>10}{c.get('failed', 0):>10}"
              f"{c.get('cancelled', 0):>10}")
    print(f"{'all':<24}{r['sent']:>10}{r['ok']:>10}{r['failed']:>10}{r['cancelled']:>10}")
    for kind, count in sorted(r["failures_by_kind"].items()):
        print(line.format(f"  failed, {kind}:", count))
    for error in r["errors"]:
        print(f"  {error}")
    print(line.format("Cancels that finished first:", r["cancel_missed"]))
    print(line.format("Choices aborted on the server:", r["server_aborted"]))
    if "server_log_disconnects" in r:
        print(line.format("Disconnects in the server log:", r["server_log_disconnects"]))
        print(line.format("Tracebacks in the server log:", r["server_log_tracebacks"]))
    rss = r["rss_bytes"]
    print(f"RSS (MiB, {r['rss_source']}):")
    for name in ("start", "warmup", "middle", "end"):
        print(line.format(f"  {name}:", _mib(rss.get(name))))
    growth = r["rss_growth_pct"]
    print(line.format("RSS growth after warm-up (%):", f"{growth:.2f}" if growth is not None else "n/a"))
    for name, value in r["gauges_at_end"].items():
        print(line.format(f"{name} at the end:", "n/a" if value is None else f"{value:g}"))
    settled = r["gauges_settled_s"]
    print(line.format("Gauges back to 0 after (s):", f"{settled:.1f}" if settled is not None else "never"))
    for name, ok in r["checks"].items():
        print(line.format(f"check {name}:", _verdict(ok)))
    print(line.format("Result:", "PASSED" if r["passed"] else "FAILED"))
    print("=" * 64)
