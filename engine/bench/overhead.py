"""`kvpilot bench overhead`: does the per-token cost outside the model grow with the output?

One long streamed request goes through the server's engine thread and stream (AsyncEngine:
scheduling, output processing, detokenizing, delta slicing, the hand-off to the event loop
and the reader). For each token the reader measures the gap since the previous one; the
engine thread records how long that step spent in `runner.run` (the forward pass and
sampling). Outside = gap - forward. Medians over a window around two positions (default
tokens 100 and 3900 of 4000) are printed side by side, with the forward pass's own time:
a cost that is O(output so far) per step shows as a larger outside time late."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections import Counter
from dataclasses import dataclass


@dataclass
class WindowFigures:
    position: int
    gap_ms: float  # median time between consecutive tokens at the reader
    forward_ms: float  # median time in runner.run for those tokens' steps
    outside_ms: float  # median of (gap - forward)


def window(gaps: list[float], forwards: list[float], position: int, half: int) -> WindowFigures:
    """Medians over tokens position-half .. position+half (token i's gap precedes it)."""
    lo, hi = max(1, position - half), min(len(gaps), position + half + 1)
    if lo >= hi:
        raise ValueError(f"position {position} is outside the {len(gaps)} tokens measured")
    g, f = gaps[lo:hi], forwards[lo:hi]
    return WindowFigures(position, 1e3 * statistics.median(g), 1e3 * statistics.median(f),
                         1e3 * statistics.median(a - b for a, b in zip(g, f)))


async def measure(engine, prompt_ids: list[int], output_len: int) -> tuple[list[float], list[float]]:
    """(gap per token, forward time of the step that made it); index 0 is the first token."""
    from ..core.sampling_params import SamplingParams
    from ..server.async_engine import AsyncEngine
    from ..metrics.exporter import ServerMetrics

    forward: list[float] = []  # engine thread: runner.run's duration per step
    run = engine.runner.run

    def timed_run(out):
        t = time.perf_counter()
        result = run(out)
        forward.append(time.perf_counter() - t)
        return result

    engine.runner.run = timed_run
    async_engine = AsyncEngine(engine, ServerMetrics("bench", engine.max_model_len))
    async_engine.start()
    gaps: list[float] = []
    step_of_token: list[int] = []
    try:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        stream = await async_engine.add("overhead", prompt_ids, params)
        last = time.perf_counter()
        async for snap in stream:
            now = time.perf_counter()
            new = sum(len(d.token_ids) for d in snap.deltas)
            # A lagging reader gets merged deltas: share the gap among their tokens.
            gaps += [(now - last) / new] * new if new else []
            step_of_token += [len(forward) - 1] * new
            last = now
    finally:
        await async_engine.stop()
        engine.runner.run = run
    # A token made by a step costs that step's forward (shared if a step made several).
    per_step = Counter(step_of_token)
    return gaps, [forward[s] / per_step[s] for s in step_of_token]


def _run(args: argparse.Namespace) -> int:
    import random

    from ..config.args import engine_config_from_args
    from ..llm_engine import LLMEngine

    config = engine_config_from_args(args)
    try:
        positions = [int(p) for p in args.positions.split(",")]
    except ValueError:
        raise ValueError(f"--positions must be comma-separated token positions, got "
                         f"{args.positions!r}") from None
    if max(positions) + args.window >= args.output_len:
        raise ValueError(f"--positions {args.positions} (+/- --window {args.window}) must lie "
                         f"below --output-len {args.output_len}")
    engine = LLMEngine(config)
    if args.prompt_len + args.output_len > engine.max_model_len:
        raise ValueError(f"--prompt-len + --output-len ({args.prompt_len + args.output_len}) "
                         f"exceeds max_model_len ({engine.max_model_len})")
    rng = random.Random(config.seed)
    prompt = [rng.randrange(16, engine.runner.vocab_size) for _ in range(args.prompt_len)]
    print(f"streaming {args.output_len} tokens after a {args.prompt_len}-token prompt ...",
          flush=True)
    t = time.perf_counter()
    gaps, forwards = asyncio.run(measure(engine, prompt, args.output_len))
    print(f"done in {time.perf_counter() - t:.1f} s ({len(gaps)} tokens)")
    print(f"{'token':>8}{'gap ms':>10}{'forward ms':>12}{'outside ms':>12}")
    rows = [window(gaps, forwards, p, args.window) for p in positions]
    for r in rows:
        print(f"{r.position:>8}{r.gap_ms:>10.3f}{r.forward_ms:>12.3f}{r.outside_ms:>12.3f}")
    if len(rows) > 1 and rows[0].outside_ms > 0:
        print(f"outside the forward pass, token {rows[-1].position} vs {rows[0].position}: "
              f"x{rows[-1].outside_ms / rows[0].outside_ms:.2f}")
    return 0


def add_parser(sub) -> None:
    from ..config.args import add_engine_args

    p = sub.add_parser("overhead", help="per-token time outside the forward pass, early vs late "
                                        "in one long streamed output")
    add_engine_args(p)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=4000)
    p.add_argument("--positions", default="100,3900", help="token positions to compare")
    p.add_argument("--window", type=int, default=50, help="tokens each side of a position")
    p.set_defaults(func=_run)
