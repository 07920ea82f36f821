"""The contest's static grid, run with exact pruning: a point is skipped only when even
every request it can accept meeting its objective could not beat the best point found so
far, so the best point found is the best of the whole grid.

The bound: a static point holds `replicas` GPUs for at least the trace's span (the last
arrival), and a request longer than its max_model_len is refused, so its good requests per
GPU-hour are at most (requests that fit) / (replicas x span). Points run in waves, fewest
GPUs first; with a split the bound is checked on the first part too (the point chosen there
must also be found)."""

from __future__ import annotations

from kvpilot.engine.fleet.scenarios import Scenario

from .contest import Contender, run_many


def _bound(lengths: list[int], c: Contender, span: float) -> float:
    fits = sum(1 for n in lengths if n <= c.max_model_len)
    return fits / (c.replicas * span / 3600.0) if span > 0 else float("inf")


def run_grid(scen: Scenario, grid: list[Contender], workers: int | None = None, split: float | None = None,
             on_done=None, control_scale: float = 1.0) -> tuple[list[dict], int]:
    """(results of the points run, how many were pruned)."""
    trace = scen.trace()
    span = max((r.arrival for r in trace), default=0.0)
    cut = (split or 0.0) * span
    lengths = [r.prompt_len + r.output_len for r in trace]
    first = [r.prompt_len + r.output_len for r in trace if r.arrival < cut]
    todo = sorted(grid, key=lambda c: (c.replicas, -c.max_num_seqs))
    wave = max(1, workers or 2)
    results: list[dict] = []
    pruned = 0
    best = best_first = 0.0
    while todo:
        keep = []
        for c in todo:
            beaten = _bound(lengths, c, span) < best
            if split is not None:
                beaten = beaten and _bound(first, c, cut) < best_first
            if beaten:
                pruned += 1
            else:
                keep.append(c)
        todo = keep
        batch, todo = todo[:wave], todo[wave:]
        if not batch:
            break
        for r in run_many(scen, batch, workers=workers, on_done=on_done, control_scale=control_scale, split=split):
            results.append(r)
            best = max(best, r["overall"]["goodput_per_gpu_hour"])
            if split is not None:
                best_first = max(best_first, r["split"]["first"]["goodput_per_gpu_hour"])
    return results, pruned


def chosen_on_first(results: list[dict]) -> dict | None:
    """The static point a user would pick having seen only the first part (best there)."""
    rows = [r for r in results if "split" in r]
    return max(rows, key=lambda r: r["split"]["first"]["goodput_per_gpu_hour"]) if rows else None
