"""Measured step times of the real engine, for calibration: drive an LLMEngine (CPU or
CUDA) through a grid of batch shapes and time every engine.step(), recording the
shape the scheduler actually gave it (new tokens and context per sequence)."""

from __future__ import annotations

import itertools
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from ..core.sampling_params import SamplingParams

# Calibration and validation use different shapes: the fit must predict what it never saw.
GRIDS = {
    "calibration": {"decode": [(b, c) for b in (1, 4, 16, 48) for c in (64, 512, 1536)],
                    "prefill": [32, 128, 512, 1024, 2048]},
    "validation": {"decode": [(b, c) for b in (2, 8, 24, 32) for c in (256, 1024)],
                   "prefill": [64, 256, 768, 1536]},
    "smoke": {"decode": [(2, 16)], "prefill": [16]},  # the recorder's own test
}
DECODE_STEPS = 4  # decode steps of the whole batch per grid point (after its prefill)
REPEATS = 3  # each grid point runs this often; every step's time is the median of its repeats


@dataclass
class StepRecord:
    requests: list[tuple[int, int]]  # (new tokens, context after the step) per sequence
    num_sampled: int
    seconds: float
    kind: str  # "decode" | "prefill" | "mixed"
    label: str = ""  # the same step of repeated runs of one grid point shares it
    grid: str = ""  # the grid it was recorded for (calibration | validation)

    @classmethod
    def from_json(cls, raw: dict) -> StepRecord:
        return cls([tuple(r) for r in raw["requests"]], int(raw["num_sampled"]), float(raw["seconds"]),
                   str(raw["kind"]), str(raw.get("label", "")), str(raw.get("grid", "")))


def _kind(requests: list[tuple[int, int]]) -> str:
    if all(new == 1 for new, _ in requests):
        return "decode"
    return "prefill" if len(requests) == 1 else "mixed"


class StepRecorder:
    """Wraps an engine's executor so each step's shape is captured while it is timed."""

    def __init__(self, engine, sync: Callable[[], None] = lambda: None) -> None:
        self.engine, self.sync = engine, sync
        self.records: list[StepRecord] = []
        self._shape: tuple[list[tuple[int, int]], int] | None = None
        run = engine.runner.run
        self._step = engine.step

        def capture(out):
            shape = [(i.num_new_tokens, i.request.num_computed_tokens + i.num_new_tokens) for i in out.scheduled]
            self._shape = (shape, sum(1 for i in out.scheduled if i.samples))
            return run(out)

        engine.runner.run = capture

    def step(self):
        """engine.step(), timed; its shape and time are recorded."""
        self._shape = None
        self.sync()
        start = time.perf_counter()
        outputs = self._step()
        self.sync()
        seconds = time.perf_counter() - start
        if self._shape is not None:
            shape, sampled = self._shape
            self.records.append(StepRecord(shape, sampled, seconds, _kind(shape)))
        return outputs

    def install(self) -> None:
        """Time every step the engine's owner runs (the server's engine thread)."""
        self.engine.step = self.step

    def run_batch(self, prompts: list[list[int]], max_tokens: int, keep_decode: int, label: str) -> None:
        """Prefill the prompts, then run `keep_decode` decode steps of the whole batch,
        recording every step as `label step K`: the scheduler is deterministic, so a
        rerun of the same lengths gives the same K-th shape, and repeats can be pooled."""
        engine = self.engine
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, detokenize=False,
                                output_kind="final_only")
        base = len(self.records)
        for i, p in enumerate(prompts):
            engine.add_request(f"rec-{label}-{base}-{i}", p, params)
        decodes = 0
        while engine.has_unfinished_requests() and (keep_decode == 0 or decodes < keep_decode):
            self.step()
            if len(self.records) > base:
                last = self.records[-1]
                last.label = f"{label} step {len(self.records) - base}"
                if last.kind == "decode" and len(last.requests) == len(prompts):
                    decodes += 1  # only the whole batch decoding counts toward the grid point
        for req in list(engine.scheduler.unfinished):
            engine.abort_request(req.out.group.request_id)


WARMUP_PROMPT = 64


def grid_max_len(grids: list[str]) -> int:
    """The max_model_len the grids' requests need."""
    need = WARMUP_PROMPT + 4
    for g in grids:
        need = max([need] + [c + DECODE_STEPS + 2 for _, c in GRIDS[g]["decode"]]
                   + [n + 1 for n in GRIDS[g]["prefill"]])
    return need


def record_grids(engine, grids: list[str], progress: Callable[[str], None] | None = None, seed: int = 0,
                 sync: Callable[[], None] = lambda: None) -> list[StepRecord]:
    """Every step of the grids' decode batches and single prefills, measured. The grids'
    points are interleaved, so a host whose speed drifts (shared, throttled machines) slows
    calibration and validation shapes alike."""
    unknown = sorted(set(grids) - set(GRIDS))
    if unknown or not grids:
        raise ValueError(f"grid must be one or more of {sorted(GRIDS)}, got {grids!r}")
    rng = random.Random(seed)
    vocab = engine.runner.vocab_size
    rec = StepRecorder(engine, sync)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(16, vocab) for _ in range(n)]

    if engine.max_model_len < grid_max_len(grids):
        raise ValueError(f"max_model_len must be at least {grid_max_len(grids)} for the grids {grids} "
                         f"(it is {engine.max_model_len})")
    rec.run_batch([prompt(WARMUP_PROMPT)] * 2, 4, 2, "warm-up")
    rec.records.clear()
    per_grid = [[(g, "decode", p) for p in GRIDS[g]["decode"]] + [(g, "prefill", n) for n in GRIDS[g]["prefill"]]
                for g in grids]
    points = [p for batch in itertools.zip_longest(*per_grid) for p in batch if p is not None]
    total = REPEATS * len(points)
    for k, (repeat, (grid, what, point)) in enumerate(itertools.product(range(REPEATS), points), 1):
        # Repeats go round the whole grid, not point by point: each shape's median then
        # pools measurements taken minutes apart, which averages out a drifting host.
        if progress:
            progress(f"[{k}/{total}] {grid}: {what} {point} (round {repeat + 1}/{REPEATS})")
        first = len(rec.records)
        if what == "decode":
            batch, context = point
            rec.run_batch([prompt(context) for _ in range(batch)], DECODE_STEPS + 2, DECODE_STEPS,
                          f"{grid} decode {batch}x{context}")
        else:
            rec.run_batch([prompt(point)], 1, 0, f"{grid} prefill {point}")
        for r in rec.records[first:]:
            r.grid = grid
    return rec.records


def write_records(path: str | Path, records: list[StepRecord], meta: dict) -> None:
    Path(path).write_text(json.dumps({**meta, "steps": [asdict(r) for r in records]}, indent=1))


def read_records(path: str | Path) -> tuple[list[StepRecord], dict]:
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"steps: cannot read {path}: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("steps"), list) or not raw["steps"]:
        raise ValueError(f"steps: {path} has no 'steps' list (write it with `kvpilot sim record`)")
    try:
        records = [StepRecord.from_json(s) for s in raw["steps"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"steps: {path}: a step record is malformed ({exc})") from None
    return records, {k: v for k, v in raw.items() if k != "steps"}


def measure_host_peaks(device: str = "cpu") -> dict[str, float]:
    """Microbenchmarks that stand in for a datasheet where there is none (a CPU): the
    dense matmul rate and the copy bandwidth torch reaches on this device."""
    import torch

    dev = torch.device(device)

    def best_of(fn, reps: int = 5) -> float:
        best = math.inf
        for _ in range(reps):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            best = min(best, time.perf_counter() - t)
        return best

    n = 1024
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    flops = 2 * n**3 / best_of(lambda: a @ b)
    src = torch.empty(32 << 20, dtype=torch.float32, device=dev)  # 128 MiB
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 4 / best_of(lambda: dst.copy_(src))
    return {"flops": flops, "bandwidth": bandwidth}


def host_accelerator():
    """This CPU as an accelerator: its peaks measured by torch microbenchmarks."""
    import os
    import sys

    from .hardware import Accelerator

    peaks = measure_host_peaks("cpu")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(f"this host's peaks (torch microbenchmarks): matmul {peaks['flops'] / 1e9:.1f} GFLOP/s, "
          f"copy {peaks['bandwidth'] / 1e9:.1f} GB/s", file=sys.stderr)
    return Accelerator(name="cpu", memory_bytes=memory, bandwidth=peaks["bandwidth"], flops=peaks["flops"],
                       reserved_bytes=0, source="torch microbenchmarks on this host")
