"""`kvpilot bench parallel`: output tokens/s of one engine on 1 process against tensor
parallelism and pipeline parallelism over several (gloo on the CPU, NCCL on CUDA), at batch
1 and a large batch, and each pipeline stage's idle share (the bubble) against GPipe's
(p - 1) / (m + p - 1) for p stages and m micro-batches.

The prompts are 128-token chunks of held-out standard-library files; greedy decoding and a
fixed output length (ignore_eos), the same prompts for every layout."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass


@dataclass
class ParallelRun:
    tp: int
    pp: int
    micro_batches: int | None
    batch: int
    num_requests: int
    output_tokens: int
    elapsed_s: float
    stage_idle_share: list[float]  # per stage (its tensor rank 0): idle / time in steps
    bubble_formula: float | None  # (p - 1) / (m + p - 1), m = the micro-batches a step had

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    def as_dict(self) -> dict:
        return asdict(self) | {"output_tokens_per_s": self.output_tokens_per_s}


def parse_layout(text: str) -> tuple[int, int]:
    try:
        tp, pp = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"layouts: {text!r} is not TPxPP (such as 2x1)") from None
    if tp < 1 or pp < 1:
        raise argparse.ArgumentTypeError(f"layouts: {text!r}: sizes must be positive")
    return tp, pp


def add_parser(bench) -> None:
    p = bench.add_parser("parallel", help="tokens/s on one process vs tensor/pipeline parallel ranks")
    p.add_argument("--model", default="builtin:tiny-trained")
    p.add_argument("--layouts", default="1x1,2x1,1x2", help="TPxPP layouts, comma-separated")
    p.add_argument("--batches", default="1,32", help="max_num_seqs values (each runs 2 x batch requests)")
    p.add_argument("--micro-batches", default="", help="for layouts with pp > 1, also these micro-batch counts")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--json", default=None, metavar="FILE", help="write the runs as JSON")
    p.set_defaults(func=cmd_bench_parallel)


def _stage_idle(reports_before: list[dict], reports_after: list[dict], tp: int) -> list[float]:
    shares = []
    for before, after in zip(reports_before[::tp], reports_after[::tp]):
        busy = after["parallel_step_seconds"] - before["parallel_step_seconds"]
        idle = after["pipeline_idle_seconds"] - before["pipeline_idle_seconds"]
        shares.append(idle / busy if busy else 0.0)
    return shares


def measure(model: str, tp: int, pp: int, micro: int | None, batch: int, prompts: list[list[int]],
            output_len: int) -> ParallelRun:
    from ..llm import LLM
    from ..core.sampling_params import SamplingParams

    llm = LLM(model, dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp,
              pipeline_micro_batches=micro, max_num_seqs=batch, enable_prefix_caching=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                     use_tqdm=False)  # warm-up: first-call costs stay out of the figure
        runner = llm.engine.runner
        before = runner.workers.reports(runner) if runner.workers else []
        work = prompts[:2 * batch]
        t0 = time.perf_counter()
        outs = llm.generate(work, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        after = runner.workers.reports(runner) if runner.workers else []
    finally:
        llm.engine.shutdown()
    m = min(micro or pp, batch)
    return ParallelRun(tp, pp, micro, batch, len(work), sum(len(o.outputs[0].token_ids) for o in outs), elapsed,
                       _stage_idle(before, after, tp) if pp > 1 else [],
                       (pp - 1) / (m + pp - 1) if pp > 1 else None)


def cmd_bench_parallel(args: argparse.Namespace) -> int:
    from .speculative import workload_prompts
    from ..loader.source import resolve_model
    from ..core.tokenizer import Tokenizer

    layouts = [parse_layout(x) for x in args.layouts.split(",") if x]
    batches = [int(x) for x in args.batches.split(",") if x]
    micros = [int(x) for x in args.micro_batches.split(",") if x]
    tokenizer = Tokenizer.from_dir(resolve_model(args.model))
    prompts = workload_prompts("free", 2 * max(batches), args.prompt_tokens, tokenizer)
    runs = []
    plan = [(tp, pp, m, b) for b in batches for tp, pp in layouts
            for m in ([None] + ([x for x in micros if x != pp] if pp > 1 else []))]
    for i, (tp, pp, m, b) in enumerate(plan, 1):
        print(f"[{i}/{len(plan)}] tp={tp} pp={pp} micro-batches={m or pp} batch={b} ...", file=sys.stderr, flush=True)
        runs.append(measure(args.model, tp, pp, m, b, prompts, args.output_len))
    print(f"{'layout':>7} {'micro':>5} {'batch':>5} {'out tok/s':>10} {'vs 1x1':>7}  stage idle share (formula)")
    for r in runs:
        base = next((x for x in runs if (x.tp, x.pp, x.batch) == (1, 1, r.batch)), None)
        ratio = f"{r.output_tokens_per_s / base.output_tokens_per_s:.2f}x" if base else "-"
        idle = (" ".join(f"{s:.0%}" for s in r.stage_idle_share) + f" ({r.bubble_formula:.0%})"
                if r.bubble_formula is not None else "")
        print(f"{r.tp}x{r.pp:<5} {r.micro_batches or r.pp:>5} {r.batch:>5} {r.output_tokens_per_s:>10.1f} "
              f"{ratio:>7}  {idle}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.as_dict() for r in runs], f, indent=2)
    return 0
