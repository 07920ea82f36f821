"""`kvpilot autotune bench-table`: the contests' JSON results (autotune contest --out) as
one table, Auto today beside Auto before (a baseline file of earlier figures), with the
ratios the issue's targets are stated in. Every figure is SIMULATED."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from .contest_plot import SIM_LABEL


def _auto(result: dict) -> dict | None:
    return next((r for r in result["results"] if r["kind"] == "auto"), None)


def row(result: dict, before: dict) -> dict:
    """One contest's figures: Auto now and before, the references, and Auto's ratios."""
    auto = _auto(result) or {}
    r = result.get("ratios", {})
    g = (auto.get("overall") or {}).get("goodput_per_gpu_hour")
    out = {"scenario": result["scenario"], "auto": g, "auto_before": before.get(result["scenario"], {}).get("auto"),
           "slo": None}
    o = auto.get("overall") or {}
    if o.get("requests"):
        out["slo"] = o["good"] / o["requests"]
    for key in ("defaults", "best_replica_only", "best_static", "static_chosen_on_first"):
        if key in r:
            out[key] = r[key]["goodput_per_gpu_hour"]
            out[f"{key}_name"] = r[key]["name"]
            out[f"x_{key}"] = r[key]["ratio"]
    return out


def print_rows(rows: list[dict]) -> None:
    def f(v, spec=".0f"):
        return "-" if v is None else format(v, spec)

    print(f"{'scenario (SIMULATED)':<36} {'Auto before':>11} {'Auto now':>9} {'SLO':>6} {'defaults':>9} "
          f"{'replica-only':>12} {'static(hind)':>12} {'static(1st)':>11} {'x def':>6} {'x rep':>6} "
          f"{'x 1st':>6}")
    for r in rows:
        print(f"{r['scenario'][:36]:<36} {f(r['auto_before']):>11} {f(r['auto']):>9} "
              f"{f(r['slo'] and 100 * r['slo'], '.1f'):>5}% {f(r.get('defaults')):>9} "
              f"{f(r.get('best_replica_only')):>12} {f(r.get('best_static')):>12} "
              f"{f(r.get('static_chosen_on_first')):>11} {f(r.get('x_defaults'), '.2f'):>6} "
              f"{f(r.get('x_best_replica_only'), '.2f'):>6} {f(r.get('x_static_chosen_on_first'), '.2f'):>6}")
    reps = [r["x_best_replica_only"] for r in rows if r.get("x_best_replica_only")]
    if reps:
        gm = math.exp(sum(math.log(x) for x in reps) / len(reps))
        print(f"geometric mean of Auto / best replica-only over {len(reps)}: x{gm:.2f}")
    for r in rows:
        names = ", ".join(f"{k}: {r[k + '_name']}" for k in ("best_replica_only", "best_static",
                                                             "static_chosen_on_first") if k + "_name" in r)
        print(f"  {r['scenario']}: {names}")
    print("(good requests per GPU-hour; static(1st) and x 1st: the static point chosen on the first part, "
          "judged beside Auto on the rest)")
    print(f"({SIM_LABEL}: modelled figures, not measured on hardware)")


def _cmd(args: argparse.Namespace) -> int:
    before = {}
    if args.before:
        try:
            before = json.loads(Path(args.before).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"before: cannot read {args.before}: {exc}") from None
    merged: dict[str, dict] = {}
    for p in args.results:
        try:
            result = json.loads(Path(p).read_text())
            merged[result["scenario"]] = merge(merged.get(result["scenario"]), result)
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"results: {p} is not a contest result ({exc})") from None
    print_rows([row(r, before) for r in merged.values()])
    return 0


def merge(old: dict | None, new: dict) -> dict:
    """Two runs of one scenario as one: the later run's contenders replace those of the
    same name (e.g. Auto re-run after a change), the ratios recomputed."""
    from .contest_cli import ratios

    if old is None:
        return new
    names = {r["name"] for r in new["results"]}
    results = [r for r in old["results"] if r["name"] not in names] + new["results"]
    return {**old, "results": results, "ratios": ratios(results)}


def add_parser(sub) -> None:
    p = sub.add_parser("bench-table", help="contest results side by side with earlier figures (SIMULATED)")
    p.add_argument("results", nargs="+", help="contest-*.json files written by kvpilot autotune contest (several "
                                              "of one scenario merge: a later file's contenders replace earlier ones)")
    p.add_argument("--before", default=None, help="a JSON of earlier figures: {scenario: {auto: ...}}")
    p.set_defaults(func=_cmd)
