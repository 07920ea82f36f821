"""gpu_check's speculative-decoding part: batch-1 output tokens/s of a random target with
Llama-3-8B's layer shapes (bf16, `layers` of its 32), without speculation, with n-gram
drafts, and with a random draft of Llama-3.2-1B's layer shapes (`draft_layers` of its
16), on a prompt that repeats one passage (so n-gram drafts can be found).

Random weights: the acceptance rates say how often a random target repeats itself (n-gram)
or agrees with an unrelated random draft (rarely), not what trained models would see; the
figures that matter are the cost side: what a verification pass of K + 1 tokens and K
draft passes cost against a plain decode step on this GPU. Tokens/s counts output tokens
over the whole generate call minus a 1-token call (prefill drops out). Failures are
recorded, not raised."""

from __future__ import annotations

import gc
import json
import time
from typing import Any

from .graphs import LLAMA3_8B
from .part import part_workdir, status_lines

LLAMA32_1B = {"layers": 16, "hidden": 2048, "heads": 32, "kv_heads": 8, "intermediate": 8192,
              "vocab": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0}


def run_speculative(
    deadline: float,
    *,
    layers: int = 8,
    draft_layers: int = 4,
    target_shape: dict[str, Any] | None = None,
    draft_shape: dict[str, Any] | None = None,
    k: int = 4,
    dtype: str = "bfloat16",
    device: str = "cuda",
    prompt_len: int = 256,
    decode_tokens: int = 128,
    llm_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    import torch

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    target = dict(target_shape or LLAMA3_8B, layers=layers)
    draft = dict(draft_shape or LLAMA32_1B, layers=draft_layers)
    draft["vocab"] = target["vocab"]  # a draft needs the target's vocabulary
    result: dict[str, Any] = {"target_shape": target, "draft_shape": draft, "dtype": dtype, "k": k,
                              "prompt_len": prompt_len, "decode_tokens": decode_tokens}
    with part_workdir(result, "kvpilot-gpu-spec-") as workdir:
        from kvpilot.engine import LLM, SamplingParams
        from kvpilot.engine.tiny.model import make_tiny_model

        t0 = time.monotonic()
        target_dir = make_tiny_model(workdir / "target", arch="llama", seed=0, dtype=dtype, **target)
        draft_dir = make_tiny_model(workdir / "draft", arch="llama", seed=1, dtype=dtype, **draft)
        result["make_models_s"] = time.monotonic() - t0
        gen = torch.Generator().manual_seed(0)
        passage = torch.randint(4, min(4000, target["vocab"]), (max(prompt_len // 4, 1),), generator=gen).tolist()
        prompt = (passage * 4)[:prompt_len]  # one passage, repeated
        methods = {
            "none": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                      "prompt_lookup_min": 2},
            "draft": {"model": str(draft_dir), "num_speculative_tokens": k},
        }
        for name, spec in methods.items():
            if time.monotonic() > deadline:
                result[name] = {"skipped": "out of time budget"}
                continue
            kwargs = {"dtype": dtype, "max_num_seqs": 1, "max_model_len": prompt_len + decode_tokens + 16,
                      **({"gpu_memory_utilization": 0.5} if device == "cuda" else {}),
                      **(llm_kwargs or {})}
            if spec is not None:
                kwargs["speculative_config"] = json.dumps(spec)
            llm = LLM(model=str(target_dir), **kwargs)
            llm.generate([prompt[:8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
            times = []
            for n in (1, decode_tokens):
                before = llm.engine.stats().spec_decode
                sync()
                t = time.monotonic()
                out = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                                   use_tqdm=False)
                sync()
                times.append(time.monotonic() - t)
            entry: dict[str, Any] = {
                "decode_tok_per_s": (decode_tokens - 1) / max(times[1] - times[0], 1e-9),
                "tokens": out[0].outputs[0].token_ids[:16]}
            after = llm.engine.stats().spec_decode
            if after is not None:
                drafted = after.num_draft_tokens - before.num_draft_tokens
                accepted = after.num_accepted_tokens - before.num_accepted_tokens
                entry.update(draft_tokens=drafted, accepted_tokens=accepted,
                             acceptance_rate=accepted / drafted if drafted else None)
            result[name] = entry
            del llm
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
        base = result.get("none", {}).get("decode_tok_per_s")
        for name in ("ngram", "draft"):
            entry = result.get(name, {})
            if base and "decode_tok_per_s" in entry:
                entry["speedup"] = entry["decode_tok_per_s"] / base
                # Speculation is exact: greedy tokens equal those without it.
                entry["same_tokens"] = entry["tokens"] == result["none"]["tokens"]
    return result


def format_speculative(result: dict[str, Any]) -> list[str]:
    """gpu_check's table lines for this part."""
    status = status_lines(result, "speculative decoding")
    if status is not None:
        return status
    lines = [f"speculative decoding, batch 1, random Llama-3-8B-shaped target ({result['target_shape']['layers']} "
             f"layers), K={result['k']}, repeated prompt:"]
    for name in ("none", "ngram", "draft"):
        entry = result.get(name, {})
        if "decode_tok_per_s" not in entry:
            lines.append(f"  {name:6s} {entry.get('skipped', 'not run')}")
            continue
        extra = ""
        if entry.get("acceptance_rate") is not None:
            extra += f", acceptance {100 * entry['acceptance_rate']:.0f}%"
        if "speedup" in entry:
            extra += f", {entry['speedup']:.2f}x" + ("" if entry["same_tokens"] else " (TOKENS DIFFER)")
        lines.append(f"  {name:6s} {entry['decode_tok_per_s']:.0f} tok/s{extra}")
    return lines
