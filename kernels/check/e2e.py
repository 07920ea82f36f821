"""gpu_check's last part: the engine end to end on a random Llama-3.2-1B-shaped model,
offline throughput at 1 and 64 concurrent requests beside ``transformers`` ``generate``
on the same weights and prompts. Failures are recorded in the result, not raised."""

from __future__ import annotations

import gc
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from kvpilot.engine.bench.quantization import common_prefix_len

# Llama-3.2-1B's shape, for make_tiny_model (random weights; nothing is downloaded).
LLAMA32_1B = {
    "layers": 16, "hidden": 2048, "heads": 32, "kv_heads": 8, "intermediate": 8192, "vocab": 128256,
    "max_position_embeddings": 131072, "tie_word_embeddings": True, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}


def run_end_to_end(
    prompt_len: int,
    max_tokens: int,
    deadline: float,
    *,
    model_shape: dict[str, Any] | None = None,
    dtype: str = "bfloat16",
    device: str = "cuda",
    concurrency: tuple[int, ...] = (1, 64),
    llm_kwargs: dict[str, Any] | None = None,
    steps_out: Path | None = None,
    step_grids: tuple[str, ...] = ("calibration", "validation"),
) -> dict[str, Any]:
    """kvpilot's offline throughput vs ``transformers`` ``generate`` on one random model;
    with `steps_out`, also the engine's step times over the simulator's grids (written
    there for `kvpilot sim calibrate --steps FILE --base h100-80gb`).

    Defaults: Llama-3.2-1B's shape in bf16 on CUDA with the Triton backend. The
    tests call it with a tiny model on the CPU to keep this path honest.
    """
    import shutil

    import torch

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    result: dict[str, Any] = {"prompt_len": prompt_len, "max_tokens": max_tokens, "dtype": dtype}
    workdir = Path(tempfile.mkdtemp(prefix="kvpilot-gpu-check-"))
    try:
        from kvpilot.engine import LLM, SamplingParams
        from kvpilot.engine.tiny.model import make_tiny_model

        shape = dict(LLAMA32_1B if model_shape is None else model_shape)
        result["model_shape"] = shape
        t0 = time.monotonic()
        model_dir = make_tiny_model(workdir / "model", arch="llama", seed=0, dtype=dtype, **shape)
        result["make_model_s"] = time.monotonic() - t0
        gen = torch.Generator().manual_seed(0)
        top = min(4000, shape["vocab"])
        prompts = torch.randint(4, top, (max(concurrency), prompt_len), generator=gen).tolist()
        kwargs = {"dtype": dtype, "max_model_len": prompt_len + max_tokens + 16, "attention_backend": "triton",
                  **({"gpu_memory_utilization": 0.5} if device == "cuda" else {}), **(llm_kwargs or {})}
        result["llm_kwargs"] = kwargs
        llm = LLM(model=str(model_dir), **kwargs)
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
        ours: dict[int, list[list[int]]] = {}
        for n in concurrency:
            if time.monotonic() > deadline:
                result[f"kvpilot_{n}"] = {"skipped": "out of time budget"}
                continue
            sync()
            t = time.monotonic()
            outs = llm.generate(prompts[:n], params, use_tqdm=False)
            sync()
            elapsed = time.monotonic() - t
            ours[n] = [list(o.outputs[0].token_ids) for o in outs]
            generated = sum(len(toks) for toks in ours[n])
            result[f"kvpilot_{n}"] = {"s": elapsed, "output_tokens": generated, "tok_per_s": generated / elapsed}
        if steps_out is not None and time.monotonic() < deadline:
            result["steps"] = _record_steps(llm.engine, model_dir, step_grids, steps_out, sync)
        del llm
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()

        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).to(device).eval()
        with torch.no_grad():
            model.generate(torch.tensor(prompts[:1], device=device), max_new_tokens=2, do_sample=False,
                           pad_token_id=0)
        for n in concurrency:
            if time.monotonic() > deadline:
                result[f"transformers_{n}"] = {"skipped": "out of time budget"}
                continue
            ids = torch.tensor(prompts[:n], device=device)  # equal lengths: no padding needed
            sync()
            t = time.monotonic()
            with torch.no_grad():
                hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                    min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            sync()
            elapsed = time.monotonic() - t
            hf_tokens = hf[:, prompt_len:].tolist()
            generated = sum(len(toks) for toks in hf_tokens)
            entry: dict[str, Any] = {"s": elapsed, "output_tokens": generated, "tok_per_s": generated / elapsed}
            if n in ours:  # greedy agreement (bf16 near-ties may legitimately diverge late)
                pairs = list(zip(ours[n], hf_tokens))
                entry["first_token_match"] = sum(a[:1] == b[:1] for a, b in pairs) / n
                entry["mean_matching_prefix"] = sum(common_prefix_len(a, b) for a, b in pairs) / n
            result[f"transformers_{n}"] = entry
        del model
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        result["traceback"] = traceback.format_exc()
    finally:
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def _record_steps(engine, model_dir: Path, grids: tuple[str, ...], out: Path, sync) -> dict[str, Any]:
    """The simulator's step grids on this engine; the JSON carries the model's config, so
    calibration needs nothing else."""
    import json

    from kvpilot.engine.sim.steps import grid_max_len, record_grids, write_records

    engine.kv_cache.enable_prefix_caching = False  # every step computes what its shape says
    engine.update_limits(max_model_len=grid_max_len(list(grids)), max_num_seqs=max(engine.max_num_seqs, 64))
    t = time.monotonic()
    records = record_grids(engine, list(grids), sync=sync)
    config = json.loads((model_dir / "config.json").read_text())
    write_records(out, records, {"model": "gpu_check random model", "config": config,
                                 "device": str(engine.runner.device), "dtype": str(engine.runner.dtype)})
    return {"file": str(out), "records": len(records), "s": time.monotonic() - t}
