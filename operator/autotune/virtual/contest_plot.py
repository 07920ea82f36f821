"""One PNG per contender of a contest run: traffic and good requests, GPUs held, the
settings in effect, the queue, and SLO attainment over time, with Auto's decisions marked
(red lines). Figures are from the simulated accelerator."""

from __future__ import annotations

import math
from pathlib import Path

SIM_LABEL = "SIMULATED accelerator"


def _bins(end: float, bin_s: float) -> int:
    return max(1, math.ceil(end / bin_s))


def _per_bin(times, bins: int, bin_s: float) -> list[int]:
    counts = [0] * bins
    for t in times:
        counts[min(int(t // bin_s), bins - 1)] += 1
    return counts


def plot_timeline(r: dict, scen, path: Path, bin_s: float | None = None, clock: str = "virtual time") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max(r["end"], 1.0)
    bin_s = bin_s or max(30.0, end / 120)
    bins = _bins(end, bin_s)
    xs = [(k + 0.5) * bin_s / 60 for k in range(bins)]
    arrivals = _per_bin(r["arrivals"], bins, bin_s)
    fig, axes = plt.subplots(5, 1, figsize=(11, 12), sharex=True)
    ax = axes[0]
    ax.plot(xs, [c / bin_s for c in arrivals], label="arrivals/s", color="tab:gray")
    ax.plot(xs, [c / bin_s for c in _per_bin(r["good_finishes"], bins, bin_s)], label="good (met SLO)/s",
            color="tab:green")
    ax.set_ylabel("requests/s")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[1]
    tl = r["gpu_timeline"] + [(end, r["gpu_timeline"][-1][1])]
    ax.step([t / 60 for t, _ in tl], [n for _, n in tl], where="post", color="tab:blue")
    ax.set_ylabel("GPUs held")
    ax = axes[2]
    st = r.get("settings_timeline") or []
    if st:
        ax.step([row[0] / 60 for row in st], [row[1] for row in st], where="post", label="max_num_seqs")
        if len(st[0]) > 4 and st[0][4]:
            ax.step([row[0] / 60 for row in st], [row[4] / 64 for row in st], where="post",
                    label="max_num_batched_tokens / 64")
        ax.set_yscale("log", base=2)
    else:
        ax.axhline(r["settings"][0], label="max_num_seqs (fixed)")
        if len(r["settings"]) > 3:
            ax.axhline(r["settings"][3] / 64, color="tab:orange", label="max_num_batched_tokens / 64 (fixed)")
    ax.set_ylabel("settings")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[3]
    queued = r.get("queue_times") or []
    if queued:
        sums = [0.0] * bins
        for t, q in queued:
            sums[min(int(t // bin_s), bins - 1)] += q or 0.0
        ax.plot(xs, [s / c if c else 0.0 for s, c in zip(sums, arrivals)], color="tab:purple")
    ax.set_ylabel("mean queue time (s)\nby arrival")
    ax = axes[4]
    good = _per_bin(r.get("good_arrivals") or [], bins, bin_s)
    ax.plot(xs, [100 * g / c if c else math.nan for g, c in zip(good, arrivals)], color="tab:green")
    ax.set_ylim(0, 105)
    ax.set_ylabel("SLO attainment %\nby arrival")
    for d in r["decisions"]:
        for a in axes:
            a.axvline(d["time"] / 60, color="tab:red", alpha=0.25, lw=0.8)
    for name, start, _ in scen.boundaries():
        for a in axes:
            a.axvline(start / 60, color="black", alpha=0.4, ls="--", lw=0.8)
        axes[0].text(start / 60, axes[0].get_ylim()[1] * 0.92, f" {name}", fontsize=8)
    split = r.get("split")
    if split:
        for a in axes:
            a.axvline(split["at"] / 60, color="tab:orange", ls=":", lw=1.2)
    axes[-1].set_xlabel(f"minutes ({clock})")
    o = r["overall"]
    fig.suptitle(f"{SIM_LABEL}: {scen.accelerator}, {scen.model}, {scen.name} - {r['name']}: "
                 f"{o['goodput_per_gpu_hour']:.0f} good req per GPU-hour (red: decisions)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
