"""`kvpilot bench throughput`: offline throughput of the engine, or of plain
transformers `generate` in static batches, on the same random prompts."""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass


@dataclass
class ThroughputResult:
    backend: str
    num_requests: int
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def as_dict(self) -> dict:
        return asdict(self) | {
            "requests_per_s": self.requests_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
        }


def sample_lengths(n: int, mean: int, range_ratio: float, rng: random.Random) -> list[int]:
    lo = max(1, int(mean * (1 - range_ratio)))
    hi = max(lo, int(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def make_workload(args, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    inputs = sample_lengths(args.num_prompts, args.input_len, args.range_ratio, rng)
    outputs = sample_lengths(args.num_prompts, args.output_len, args.range_ratio, rng)
    # Avoid the lowest ids, where a tokenizer keeps its special tokens.
    return [([rng.randrange(16, vocab_size) for _ in range(i)], o) for i, o in zip(inputs, outputs)]


def run_kvpilot(args, workload) -> ThroughputResult:
    from .llm import LLM
    from .sampling_params import SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o) for _, o in workload]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in workload], params)
    elapsed = time.perf_counter() - start
    return ThroughputResult("kvpilot", len(workload), elapsed,
                            sum(len(p) for p, _ in workload),
                            sum(len(o.outputs[0].token_ids) for o in outs))


def run_hf(args, workload) -> ThroughputResult:
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    from .model_source import resolve_model

    path = resolve_model(args.model)
    dtype = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    pad = 0
    useful = 0
    start = time.perf_counter()
    batches = [workload[i : i + args.hf_batch_size] for i in range(0, len(workload), args.hf_batch_size)]
    for batch in tqdm(batches, desc="hf generate", unit="batch"):
        width = max(len(p) for p, _ in batch)
        new = max(o for _, o in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=pad)
        # A static batch runs to its longest output; only the requested tokens count.
        useful += sum(o for _, o in batch)
    elapsed = time.perf_counter() - start
    return ThroughputResult("hf", len(workload), elapsed, sum(len(p) for p, _ in workload), useful)


def print_result(r: ThroughputResult) -> None:
    print(f"{'=' * 16} Throughput Benchmark Result ({r.backend}) {'=' * 16}")
    print(f"{'Successful requests:':<40}{r.num_requests:<10}")
    print(f"{'Benchmark duration (s):':<40}{r.elapsed_s:<10.2f}")
    print(f"{'Total input tokens:':<40}{r.prompt_tokens:<10}")
    print(f"{'Total generated tokens:':<40}{r.output_tokens:<10}")
    print(f"{'Request throughput (req/s):':<40}{r.requests_per_s:<10.2f}")
    print(f"{'Output token throughput (tok/s):':<40}{r.output_tokens_per_s:<10.2f}")
    print(f"{'Total token throughput (tok/s):':<40}{r.total_tokens_per_s:<10.2f}")
    print("=" * 66)


def _run(args: argparse.Namespace) -> int:
    from .model_config import ModelConfig
    from .model_source import resolve_model

    vocab = ModelConfig.from_dir(resolve_model(args.model)).vocab_size
    workload = make_workload(args, vocab)
    results = []
    for backend in args.backend:
        result = run_kvpilot(args, workload) if backend == "kvpilot" else run_hf(args, workload)
        results.append(result)
        if not args.json:
            print_result(result)
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=2))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("throughput", help="offline throughput (kvpilot engine or transformers)")
    p.add_argument("--model", required=True)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from [len*(1-r), len*(1+r)]")
    p.add_argument("--backend", nargs="+", default=["kvpilot"], choices=("kvpilot", "hf"))
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run)
