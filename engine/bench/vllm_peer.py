"""Runs one `kvpilot bench throughput` workload through real vLLM's offline `LLM.generate`.

Executed as a script by the interpreter of a virtualenv that has vLLM (for example one
made by install-vllm-cpu.sh), so it imports nothing of kvpilot. It reads a JSON spec from
stdin (model, prompts as token ids, output lengths, engine settings) and writes its
figures as JSON to the file the spec names (vLLM logs to stdout and stderr)."""

import json
import sys
import time


def main() -> None:
    spec = json.load(sys.stdin)
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], dtype=spec["dtype"], enforce_eager=spec["enforce_eager"],
              max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              max_model_len=spec["max_model_len"],
              seed=spec["seed"], enable_prefix_caching=spec["enable_prefix_caching"])
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
              for n in spec["output_lens"]]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    result = {"elapsed_s": elapsed, "num_requests": len(outputs),
              "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
              "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}
    with open(spec["result_file"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM's CPU workers re-import the main module
    main()
