"""`kvpilot sim fidelity`: how faithfully the simulator reproduces the real engine on
this machine, measured end to end.

1. Step times: the real engine runs the calibration and validation grids (interleaved);
   the timing model is fitted on the calibration shapes and predicts the validation ones.
2. Serving: a real `kvpilot serve` records its step times under `bench serve`
   workloads: A at the concurrency of the judged workload B but with longer prompts
   and answers, A' at other concurrencies. Each fit drives a simulated server; the real
   and simulated servers then run B, alternately, and their bench figures are compared.
   The grid-calibrated description runs B too. On a CPU, a serving step is slower than
   the same step offline: the HTTP server, the streams and the benchmark client share the
   cores (and the GIL) with the engine, by an amount that depends on how many streams
   run, which a GPU would not feel and no step shape can tell.
"""

from __future__ import annotations

import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ..bench.serve import BenchConfig, run_benchmark
from .calibrate import errors, fit, measured_shapes, predict
from ..sim.hardware import Accelerator
from ..sim.shapes import resolve_model_shape
from ..sim.steps import host_accelerator, read_records, record_grids, write_records

# The workload the simulated servers are judged on, and the serving workloads calibrated on:
# A at B's concurrency but 3x the prompts and 2x the answers; A' at other concurrencies.
WORKLOAD_B = dict(random_input_len=200, random_output_len=100, random_range_ratio=0.5, num_prompts=150,
                  max_concurrency=12, seed=2)
CALIBRATIONS = {
    "serve A (concurrency 12, longer)": [dict(random_input_len=600, random_output_len=200, random_range_ratio=0.5,
                                              num_prompts=100, max_concurrency=12, seed=5)],
    "serve A' (concurrency 4 and 24)": [dict(random_input_len=800, random_output_len=200, random_range_ratio=0.5,
                                              num_prompts=40, max_concurrency=4, seed=1),
                                         dict(random_input_len=150, random_output_len=60, random_range_ratio=0.5,
                                              num_prompts=200, max_concurrency=24, seed=3)],
}
SERVE = ["--served-model-name", "m", "--max-num-seqs", "32", "--max-model-len", "2048",
         "--kv-cache-memory", "256Mi", "--disable-uvicorn-access-log"]
FIGURES = ("output_throughput", "median_ttft_ms", "median_tpot_ms")


def _say(msg: str) -> None:
    print(f"[fidelity {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_and_bench(args: list[str], workloads: list[dict], log: Path, deadline_s: float = 300) -> list[dict]:
    """Start `kvpilot serve ARGS`, run each workload through bench serve, stop it."""
    port = _free_port()
    cmd = [sys.executable, "-m", "kvpilot.engine.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           *SERVE, *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            end = time.monotonic() + deadline_s
            while time.monotonic() < end:
                if proc.poll() is not None:
                    raise RuntimeError(f"kvpilot serve exited {proc.returncode}; see {log}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            else:
                raise TimeoutError(f"kvpilot serve not healthy in {deadline_s}s; see {log}")
            return [run_benchmark(BenchConfig(base_url=f"http://127.0.0.1:{port}", model="m",
                                              disable_tqdm=True, **w)) for w in workloads]
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _figures(runs: list[dict]) -> dict:
    return {k: statistics.fmean(r[k] for r in runs) for k in FIGURES}


def run_fidelity(out_dir: Path, rounds: int = 2) -> dict:
    import torch  # noqa: F401  (the real engine runs here; fail early without it)

    from ..config.engine import EngineConfig
    from ..llm_engine import LLMEngine

    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvpilot-fidelity-"))
    model = resolve_model_shape("builtin:tiny", "float32")
    base: Accelerator = host_accelerator()
    result: dict = {"model": "builtin:tiny (float32)", "host_peaks": {"flops": base.flops, "bandwidth": base.bandwidth}}

    _say("1/3 recording the real engine's step times over the calibration and validation grids")
    engine = LLMEngine(EngineConfig(model="builtin:tiny", enable_prefix_caching=False))
    grid_steps = record_grids(engine, ["calibration", "validation"], progress=lambda s: None)
    del engine
    write_records(out_dir / "sim-fidelity-grid-steps.json", grid_steps, {"model": "builtin:tiny"})
    grid_acc, grid_fit = fit(model, base, [r for r in grid_steps if r.grid == "calibration"])
    grid_val = errors(model, grid_acc, [r for r in grid_steps if r.grid == "validation"])
    result["grid"] = {"fit": grid_fit.__dict__, "validation": grid_val.__dict__,
                      "accelerator": grid_acc.to_json()}
    _say(f"grid fit: {grid_fit.describe()}")
    _say(f"grid validation: {grid_val.describe()}")

    sim = ["--simulate-model", "builtin:tiny", "--dtype", "float32"]
    variants = {"grid (offline)": grid_acc}
    result["serve"] = {}
    for name, workloads in CALIBRATIONS.items():
        _say(f"2/3 recording a real server's step times under {name}")
        steps_file = work / f"serve-steps-{len(variants)}.json"
        bench = _serve_and_bench(["--model", "builtin:tiny", "--record-steps", str(steps_file)], workloads,
                                 work / f"serve-{len(variants)}.log")
        steps, _ = read_records(steps_file)
        acc, report = fit(model, base, steps)
        variants[name] = acc
        result["serve"][name] = {"workloads": workloads, "bench": [{k: r[k] for k in FIGURES} for r in bench],
                                 "fit": report.__dict__, "accelerator": acc.to_json(), "steps": len(steps)}
        _say(f"fit on {name}: {report.describe()}")
    for k, acc in enumerate(variants.values()):
        (work / f"acc-{k}.json").write_text(json.dumps(acc.to_json()))

    _say(f"3/3 workload B on the real server and the simulated ones, {rounds} rounds alternating")
    runs: dict[str, list[dict]] = {"real": [], **{f"simulated, calibrated on {n}": [] for n in variants}}
    for k in range(rounds):
        runs["real"] += _serve_and_bench(["--model", "builtin:tiny"], [WORKLOAD_B], work / f"real-{k}.log")
        for j, n in enumerate(variants):
            runs[f"simulated, calibrated on {n}"] += _serve_and_bench(
                ["--simulate", str(work / f"acc-{j}.json"), *sim], [WORKLOAD_B], work / f"sim-{j}-{k}.log")
        _say(f"round {k + 1}: " + ", ".join(f"{n} {r[-1]['output_throughput']:.0f} tok/s" for n, r in runs.items()))
    real = _figures(runs["real"])
    result["workload_b"] = {name: {"figures": _figures(rs), "runs": [{k: r[k] for k in FIGURES} for r in rs],
                                   "error": {k: _figures(rs)[k] / real[k] - 1 for k in FIGURES}}
                            for name, rs in runs.items()}
    result["workload_b_spec"] = WORKLOAD_B
    (out_dir / "sim-fidelity.json").write_text(json.dumps(result, indent=2))
    _plot(out_dir / "sim-fidelity.png", model, grid_acc, grid_steps)
    return result


def _plot(path: Path, model, acc, records) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    for grid, marker in (("calibration", "o"), ("validation", "^")):
        pairs = measured_shapes([r for r in records if r.grid == grid])
        ax.scatter([s * 1e3 for _, s in pairs], [predict(model, acc, r) * 1e3 for r, _ in pairs],
                   marker=marker, s=18, alpha=0.7, label=f"{grid} shapes")
    lo, hi = ax.get_xlim()
    ax.plot([lo, hi], [lo, hi], "k--", lw=1)
    ax.plot([lo, hi], [lo * 1.2, hi * 1.2], ":", color="grey", lw=1)
    ax.plot([lo, hi], [lo / 1.2, hi / 1.2], ":", color="grey", lw=1, label="±20 %")
    ax.set(xscale="log", yscale="log", xlabel="measured step time, real engine (ms)",
           ylabel="predicted by the timing model (ms)",
           title="Timing model fitted on the calibration shapes (CPU, builtin:tiny)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_fidelity(r: dict) -> None:
    g = r["grid"]["validation"]
    print(f"step times, validation shapes ({g['n']}): median |error| {g['median_abs_rel']:.1%}, "
          f"p90 {g['p90_abs_rel']:.1%} (target <= 10 % and <= 20 %)")
    print(f"bench serve workload B (input {WORKLOAD_B['random_input_len']}, output "
          f"{WORKLOAD_B['random_output_len']}, ratio {WORKLOAD_B['random_range_ratio']}, concurrency "
          f"{WORKLOAD_B['max_concurrency']}); the simulated servers are SIMULATED:")
    print(f"{'server':58}{'output tok/s':>13}{'TTFT median':>13}{'TPOT median':>13}")
    for name, v in r["workload_b"].items():
        f, e = v["figures"], v["error"]
        err = "" if name == "real" else (f"  errors {e['output_throughput']:+.0%} / {e['median_ttft_ms']:+.0%}"
                                         f" / {e['median_tpot_ms']:+.0%}")
        print(f"{name:58}{f['output_throughput']:>13.1f}{f['median_ttft_ms']:>11.1f}ms"
              f"{f['median_tpot_ms']:>11.2f}ms{err}")
