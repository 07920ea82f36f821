"""`kvpilot bench speculative`: output tokens/s with n-gram and draft-model speculation
against none, at batch 1 and a large batch, on two workloads cut from held-out Python
standard library files (text the trained tiny models never saw):

- repetitive: a source chunk, a blank line, then the chunk's first lines again: the
  continuation can quote the chunk (as a summary or an edit quotes its input);
- free: the start of a file, continued freely.

Greedy decoding, a fixed output length (ignore_eos), the same prompts for every method.
Per method the acceptance rate and accepted tokens per draft position come from the
engine's own counters (the vllm:spec_decode_* series)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

WORKLOADS = ("repetitive", "free")


@dataclass
class SpecRun:
    method: str  # none | ngram | draft
    workload: str
    batch: int
    num_requests: int
    output_tokens: int
    elapsed_s: float
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    def as_dict(self) -> dict:
        return asdict(self) | {"output_tokens_per_s": self.output_tokens_per_s,
                               "acceptance_rate": self.acceptance_rate}


def workload_prompts(kind: str, count: int, prompt_tokens: int, tokenizer) -> list[list[int]]:
    """`count` token-id prompts of about `prompt_tokens` tokens from held-out files."""
    from ..tiny.train import corpus_split

    _, heldout = corpus_split()
    prompts: list[list[int]] = []
    for path in heldout:
        text = path.read_text(encoding="utf-8", errors="replace")
        ids = tokenizer.encode(text)
        # Several prompts per file, from different places, until there are enough.
        for start in range(0, max(len(ids) - prompt_tokens, 1), prompt_tokens * 4):
            chunk = ids[start:start + prompt_tokens]
            if len(chunk) < prompt_tokens:
                break
            if kind == "repetitive":
                text_chunk = tokenizer.decode(chunk)
                lines = text_chunk.splitlines(keepends=True)
                chunk = tokenizer.encode(text_chunk + "\n\n" + "".join(lines[:max(1, len(lines) // 3)]))
            prompts.append(chunk)
            if len(prompts) == count:
                return prompts
    raise ValueError(f"the held-out files give only {len(prompts)} prompts of {prompt_tokens} tokens, "
                     f"{count} wanted")


def measure(llm, method: str, workload: str, batch: int, prompts: list[list[int]], output_len: int) -> SpecRun:
    from ..core.sampling_params import SamplingParams

    engine = llm.engine
    engine.update_limits(max_num_seqs=batch)
    before = engine.stats().spec_decode
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    run = SpecRun(method, workload, batch, len(prompts), sum(len(o.outputs[0].token_ids) for o in outs), elapsed)
    after = engine.stats().spec_decode
    if after is not None:
        run.num_drafts = after.num_drafts - before.num_drafts
        run.num_draft_tokens = after.num_draft_tokens - before.num_draft_tokens
        run.num_accepted_tokens = after.num_accepted_tokens - before.num_accepted_tokens
        run.accepted_per_pos = [a - b for a, b in zip(after.accepted_per_pos, before.accepted_per_pos)]
    return run


def run_all(args: argparse.Namespace) -> list[SpecRun]:
    from ..llm import LLM

    methods = {
        "none": None,
        "ngram": json.dumps({"method": "ngram", "num_speculative_tokens": args.k,
                             "prompt_lookup_max": 4, "prompt_lookup_min": 2}),
        "draft": json.dumps({"model": args.draft, "num_speculative_tokens": args.k}),
    }
    runs: list[SpecRun] = []
    prompts_by_workload = None
    total = len(args.methods) * len(args.workloads) * len(args.batch_sizes)
    done = 0
    for method in args.methods:
        llm = LLM(args.model, dtype="float32", max_num_seqs=max(args.batch_sizes), seed=0,
                  speculative_config=methods[method], kv_cache_memory=args.kv_cache_memory)
        if prompts_by_workload is None:
            tok = llm.get_tokenizer()
            n = max(args.batch_sizes) * args.waves
            prompts_by_workload = {w: workload_prompts(w, n, args.prompt_tokens, tok) for w in WORKLOADS}
        measure(llm, method, "warm-up", 1, prompts_by_workload["free"][:1], 8)
        for workload in args.workloads:
            for batch in args.batch_sizes:
                # Batch 1 runs `waves` requests one after another; batch B runs B * waves.
                prompts = prompts_by_workload[workload][:batch * args.waves]
                run = measure(llm, method, workload, batch, prompts, args.output_len)
                runs.append(run)
                done += 1
                rate = f"{run.acceptance_rate:.0%}" if run.acceptance_rate is not None else "-"
                print(f"[{done}/{total}] {method:<6} {workload:<11} batch {batch:<3} "
                      f"{run.output_tokens_per_s:8.1f} output tok/s  acceptance {rate}",
                      file=sys.stderr, flush=True)
    return runs


def print_table(runs: list[SpecRun]) -> None:
    base = {(r.workload, r.batch): r.output_tokens_per_s for r in runs if r.method == "none"}
    print(f"{'workload':<12}{'batch':>6}{'method':>8}{'out tok/s':>11}{'speedup':>9}{'accept':>8}  accepted per position")
    for r in runs:
        ref = base.get((r.workload, r.batch))
        speedup = f"{r.output_tokens_per_s / ref:.2f}x" if ref else "-"
        accept = f"{r.acceptance_rate:.0%}" if r.acceptance_rate is not None else "-"
        per_pos = (" ".join(f"{a / r.num_drafts:.2f}" for a in r.accepted_per_pos)
                   if r.num_drafts else "")
        print(f"{r.workload:<12}{r.batch:>6}{r.method:>8}{r.output_tokens_per_s:>11.1f}{speedup:>9}{accept:>8}  {per_pos}")


def plot(runs: list[SpecRun], path: Path) -> None:
    """Speedup over no speculation per workload and batch, one bar per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = {(r.workload, r.batch): r.output_tokens_per_s for r in runs if r.method == "none"}
    groups = sorted({(r.workload, r.batch) for r in runs}, key=lambda g: (WORKLOADS.index(g[0]), g[1]))
    methods = [m for m in ("ngram", "draft") if any(r.method == m for r in runs)]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / max(len(methods), 1)
    for j, method in enumerate(methods):
        ys = [next((r.output_tokens_per_s / base[g] for r in runs if r.method == method and (r.workload, r.batch) == g),
                   0.0) for g in groups]
        ax.bar([i + j * width for i in range(len(groups))], ys, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{w}\nbatch {b}" for w, b in groups])
    ax.set_ylabel("output tokens/s vs no speculation")
    ax.set_title("Speculative decoding on this CPU (greedy)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _run(args: argparse.Namespace) -> int:
    for name in ("k", "output_len", "prompt_tokens", "waves"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {value}")
    if any(b < 1 for b in args.batch_sizes):
        raise ValueError(f"batch-sizes must be >= 1, got {args.batch_sizes}")
    runs = run_all(args)
    if args.json:
        print(json.dumps([r.as_dict() for r in runs], indent=2))
    else:
        print_table(runs)
    if args.plot:
        plot(runs, Path(args.plot))
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("speculative", help="speculative decoding (n-gram, draft model) against none")
    p.add_argument("--model", default="builtin:tiny-trained")
    p.add_argument("--draft", default="builtin:tiny-draft", help="the draft model of --methods draft")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--methods", nargs="+", default=["none", "ngram", "draft"], choices=("none", "ngram", "draft"))
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32])
    p.add_argument("--waves", type=int, default=2, help="requests per batch slot (batch 1: requests in a row)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--kv-cache-memory", default="512Mi")
    p.add_argument("--plot", default=None, metavar="PNG", help="write the speedup chart here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run)
