"""gpu_check's tensor-parallel part: the multi-process engine's code path with one rank on
one GPU (a process group of 1 under NCCL, the sharded safetensors loader, the step sent
through the group's CPU channel), against the plain engine on the same random model with
Llama-3-8B's layer shapes (`layers` of its 32, bf16): the same greedy tokens, the bytes
the sharded loader read, and both engines' decode tokens/s. Failures are recorded, not
raised."""

from __future__ import annotations

import gc
import os
import time
from typing import Any

from .graphs import LLAMA3_8B
from .part import part_workdir, status_lines


def run_parallel(deadline: float, *, layers: int = 4, shape: dict[str, Any] | None = None,
                 dtype: str = "bfloat16", device: str = "cuda", prompt_len: int = 128,
                 decode_tokens: int = 64, llm_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    import torch

    shape = dict(shape or LLAMA3_8B, layers=layers)
    result: dict[str, Any] = {"shape": shape, "dtype": dtype}
    with part_workdir(result, "kvpilot-gpu-tp-") as workdir:
        from kvpilot.engine import LLM, SamplingParams
        from kvpilot.engine.tiny.model import make_tiny_model

        model_dir = make_tiny_model(workdir / "m", arch="llama", seed=0, dtype=dtype, **shape)
        prompt = torch.randint(4, min(4000, shape["vocab"]), (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
        for name, env in (("plain", None), ("parallel_executor_world_1", "1")):
            if time.monotonic() > deadline:
                result[name] = {"skipped": "out of time budget"}
                continue
            if env:
                os.environ["KVPILOT_PARALLEL_EXECUTOR"] = env
            try:
                kwargs = {"dtype": dtype, "max_num_seqs": 1, "max_model_len": prompt_len + decode_tokens + 16,
                          **({"gpu_memory_utilization": 0.5, "enforce_eager": True} if device == "cuda" else {}),
                          **(llm_kwargs or {})}
                llm = LLM(model=str(model_dir), **kwargs)
            finally:
                os.environ.pop("KVPILOT_PARALLEL_EXECUTOR", None)
            runner = llm.engine.runner
            llm.generate([prompt[:8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
            times = []
            for n in (1, decode_tokens):
                if device == "cuda":
                    torch.cuda.synchronize()
                t = time.monotonic()
                out = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                                   use_tqdm=False)
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.monotonic() - t)
            result[name] = {"decode_tok_per_s": (decode_tokens - 1) / max(times[1] - times[0], 1e-9),
                            "tokens": out[0].outputs[0].token_ids[:32],
                            "describe": runner.describe(),
                            "load_bytes_read": runner.load_bytes_read}
            llm.engine.shutdown()
            del llm, runner
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
        plain, par = result.get("plain", {}), result.get("parallel_executor_world_1", {})
        if "tokens" in plain and "tokens" in par:
            result["same_tokens"] = plain["tokens"] == par["tokens"]
            result["checkpoint_bytes"] = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    return result


def format_parallel(result: dict[str, Any]) -> list[str]:
    """gpu_check's table lines for this part."""
    status = status_lines(result, "tensor-parallel code path")
    if status is not None:
        return status
    plain, par = result.get("plain", {}), result.get("parallel_executor_world_1", {})
    lines = [f"tensor-parallel code path, world size 1 (random Llama-3-8B-shaped, {result['shape']['layers']} layers):"]
    for name, entry in (("plain", plain), ("1 rank", par)):
        if "decode_tok_per_s" in entry:
            lines.append(f"  {name:7s} {entry['decode_tok_per_s']:.0f} tok/s  ({entry['describe'][-60:]})")
    if "same_tokens" in result:
        lines.append(f"  greedy tokens {'equal' if result['same_tokens'] else 'DIFFER'}; sharded loader read "
                     f"{par.get('load_bytes_read', 0) / 2**20:.1f} MiB of a {result['checkpoint_bytes'] / 2**20:.1f} MiB checkpoint")
    return lines
