"""The pure parts of `make autotune-bench` and `make demo`: samples of the
signals over time, goodput, the time the autotuner took to converge, the
results table and the timeline PNG (matplotlib, Agg backend).

Nothing here talks to a cluster; tests/operator/autotune/virtual/test_autotune_bench_units.py covers it."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence


@dataclass
class Sample:
    """One look at a deployment: seconds since the run started, the engine's
    signals over a short window (Prometheus), the settings in effect and the
    autotuner's diagnosis (status.autotune)."""
    t: float
    kv_pct: float | None = None
    preempt_per_s: float | None = None
    queue_p95_s: float | None = None
    tpot_p95_ms: float | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    replicas: int | None = None
    diagnosis: str | None = None
    ttft_p95_s: float | None = None
    tokens_per_s: float | None = None  # output tokens/s, all pods


@dataclass
class Change:
    """An applied autotuner decision (or a setting the benchmark changed itself)."""
    t: float  # seconds since the run started
    change: dict[str, list[int]] = field(default_factory=dict)  # {"maxNumSeqs": [64, 32]}
    action: str = "change"
    reason: str = ""

    def label(self) -> str:
        what = ", ".join(f"{_SHORT.get(k, k)} {a}->{b}" for k, (a, b) in self.change.items())
        return f"{self.action}: {what}" if self.action != "change" else what


_SHORT = {"maxNumSeqs": "seqs", "maxModelLen": "len", "replicas": "replicas"}


# --- measures -----------------------------------------------------------------------
@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    tpot_ms: float

    def describe(self) -> str:
        return f"TTFT <= {self.ttft_ms / 1000:g} s and TPOT <= {self.tpot_ms:g} ms"


def meets_slo(ttft_s: float | None, tpot_s: float | None, slo: Slo) -> bool:
    """A request meets the objective when it succeeded (has a TTFT) and both its TTFT
    and its time per output token (None for one-token answers: no TPOT to miss) are
    within the bounds."""
    if ttft_s is None:
        return False
    return ttft_s * 1000 <= slo.ttft_ms and (tpot_s is None or tpot_s * 1000 <= slo.tpot_ms)


def goodput(requests: Iterable[tuple[float | None, float | None]], duration_s: float, slo: Slo) -> float:
    """Requests per second that met the objective; `requests` holds (ttft_s, tpot_s)
    per request sent (failed ones as (None, None))."""
    if duration_s <= 0:
        return 0.0
    return sum(1 for ttft, tpot in requests if meets_slo(ttft, tpot, slo)) / duration_s


def goodput_after(run: dict, since_s: float | None, slo: Slo) -> float | None:
    """Goodput of the requests sent `since_s` seconds or more after the load started,
    over the time from then to the run's end (None without per-request outcomes)."""
    outcomes = run.get("outcomes")
    if not outcomes or since_s is None or run.get("duration_s", 0) <= since_s:
        return None
    later = [(ttft, tpot) for sent, ttft, tpot in outcomes if sent >= since_s]
    return goodput(later, run["duration_s"] - since_s, slo)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def convergence_time(changes: Sequence[Change], run_start: float = 0.0) -> float | None:
    """Seconds from the run's start to the last applied change: the first moment after
    which nothing changed any more. 0.0 when nothing was ever changed; None when the
    input is None-like (no timeline)."""
    applied = [c.t for c in changes if c.change]
    if not applied:
        return 0.0
    return max(0.0, max(applied) - run_start)


_SAMPLE_KEYS = {"maxNumSeqs": "max_num_seqs", "maxModelLen": "max_model_len", "replicas": "replicas"}


def observed_changes(samples: Sequence[Sample], changes: Sequence[Change], slack_s: float = 30.0) -> list[Change]:
    """Setting changes seen in the samples' effective settings that no recorded decision
    explains (a decision for the same setting within `slack_s` before it), as Changes
    with action "observed": a decision that left the status history before it was
    sampled still shows up on the timeline and in the convergence time."""
    out: list[Change] = []
    for key, attr in _SAMPLE_KEYS.items():
        prev = None
        for s in samples:
            v = getattr(s, attr)
            if v is None:
                continue
            if prev is not None and v != prev and not any(
                    key in c.change and s.t - slack_s <= c.t <= s.t + 1 for c in changes):
                out.append(Change(s.t, {key: [prev, v]}, action="observed"))
            prev = v
    return sorted(out, key=lambda c: c.t)


# --- table --------------------------------------------------------------------------
COLUMNS = [("run", "<26"), ("settings", "<27"), ("goodput/s", ">9"), ("req/s", ">6"), ("tok/s", ">7"),
           ("TTFT p95", ">9"), ("TPOT p95", ">9"), ("preempt", ">7"), ("done", ">5"), ("time", ">6")]


def _fmt(v, spec: str, unit: str = "") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec) + unit


def table_header() -> str:
    return " ".join(format(name, align) for name, align in COLUMNS)


def table_row(name: str, r: dict) -> str:
    """One row from a run's result dict (keys as written by autotune_bench.summarize_run)."""
    cells = [name, r.get("settings", "-"), _fmt(r.get("goodput"), ".3f"), _fmt(r.get("throughput"), ".3f"),
             _fmt(r.get("output_tok_s"), ".1f"), _fmt(r.get("ttft_p95_s"), ".2f", "s"),
             _fmt(None if r.get("tpot_p95_s") is None else r["tpot_p95_s"] * 1000, ".0f", "ms"),
             _fmt(r.get("preemptions"), ".0f"), _fmt(r.get("completed"), "d"),
             _fmt(r.get("duration_s"), ".0f", "s")]
    return " ".join(format(c, align) for c, (_, align) in zip(cells, COLUMNS))


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def format_table(rows: Sequence[tuple[str, dict]], slo: Slo, auto_key: str | None = None,
                 default_key: str | None = None, best_key: str | None = None,
                 converge_s: float | None = None) -> str:
    """The benchmark's printed table: one row per run, then the ratios and the
    time Auto took to converge."""
    lines = [f"goodput = requests/s meeting {slo.describe()}", table_header()]
    lines += [table_row(name, r) for name, r in rows]
    by = dict(rows)
    auto = by.get(auto_key) if auto_key else None
    if auto is not None:
        for label, key in (("default", default_key), ("best static", best_key)):
            other = by.get(key) if key else None
            if other is None:
                continue
            g = ratio(auto.get("goodput"), other.get("goodput"))
            t = ratio(auto.get("throughput"), other.get("throughput"))
            lines.append(f"autotuned / {label:<11}: goodput x{_fmt(g, '.2f')}, throughput x{_fmt(t, '.2f')}")
        if converge_s is not None:
            lines.append(f"Auto converged {converge_s:.0f}s after the load started "
                         "(its last applied change; nothing changed after it until the run ended)")
        else:
            lines.append("Auto convergence: unknown (no timeline)")
    return "\n".join(lines)


# --- timeline PNG -----------------------------------------------------------------
PANELS = [("kv_pct", "KV cache %"), ("preempt_per_s", "preemptions/s"), ("queue_p95_s", "queue p95 (s)"),
          ("tpot_p95_ms", "TPOT p95 (ms)"), ("max_num_seqs", "max_num_seqs"), ("replicas", "replicas")]
LABELS = {"ttft_p95_s": "TTFT p95 (s)", "tokens_per_s": "output tokens/s", **dict(PANELS)}


def write_timeline_png(samples: Sequence[Sample], changes: Sequence[Change], path: str | Path,
                       title: str = "kvpilot autotuner timeline",
                       phases: Sequence[tuple[float, str]] = (),
                       objectives: dict[str, float] | None = None,
                       panels: Sequence[str] | None = None) -> Path:
    """Stacked panels over time (by default KV %, preemptions/s, queue p95, TPOT p95,
    max_num_seqs, replicas; `panels` picks Sample fields); every applied change is a
    dashed vertical line labelled on the top panel; `phases` (t, name) are grey lines
    marking parts of a longer run; `objectives` (panel key -> value) draws an objective
    as a green horizontal line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    panels = [(key, LABELS[key]) for key in panels] if panels else PANELS
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 10.5), sharex=True)
    ts = [s.t for s in samples]
    for ax, (key, label) in zip(axes, panels):
        ys = [getattr(s, key) for s in samples]
        xs = [t for t, y in zip(ts, ys) if y is not None]
        ys = [y for y in ys if y is not None]
        step = key in ("max_num_seqs", "replicas")
        if xs:
            (ax.step if step else ax.plot)(xs, ys, **({"where": "post"} if step else {}), lw=1.5)
        ax.set_ylabel(label, fontsize=8)
        if step:
            from matplotlib.ticker import MaxNLocator
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylim(0, (max(ys) if ys else 1) * 1.15 + 0.5)
        ax.grid(True, alpha=0.3)
        if objectives and key in objectives:
            ax.axhline(objectives[key], color="tab:green", lw=1, alpha=0.8)
        for c in changes:
            if c.change:
                ax.axvline(c.t, color="tab:red", ls="--", lw=1, alpha=0.8)
        for t, _ in phases:
            ax.axvline(t, color="grey", ls=":", lw=1)
    top = axes[0]
    ymax = top.get_ylim()[1]
    for c in changes:
        if c.change:
            top.text(c.t, ymax, " " + c.label(), rotation=90, va="top", ha="left", fontsize=7, color="tab:red")
    for t, name in phases:
        axes[-1].text(t, axes[-1].get_ylim()[0], " " + name, rotation=90, va="bottom", fontsize=7, color="grey")
    axes[-1].set_xlabel("seconds since start")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def samples_to_json(samples: Sequence[Sample]) -> list[dict]:
    return [asdict(s) for s in samples]


def changes_to_json(changes: Sequence[Change]) -> list[dict]:
    return [asdict(c) for c in changes]
