"""`bench throughput --backend vllm`: the same token-id prompts and output lengths go to
vLLM's offline API in another interpreter. vLLM is never needed here: a stand-in `vllm`
package records what it was given and answers in vLLM's output shape."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest

from kvpilot.engine.cli import main

FAKE_VLLM = textwrap.dedent('''
    import json, os
    from types import SimpleNamespace

    class SamplingParams:
        def __init__(self, temperature, ignore_eos, max_tokens):
            self.max_tokens = max_tokens

    class LLM:
        def __init__(self, **settings):
            self.settings = settings

        def generate(self, prompts, params, use_tqdm):
            with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
                f.write(json.dumps({"settings": self.settings, "cwd": os.getcwd(),
                                    "kv_space": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
                                    "prompts": [p["prompt_token_ids"] for p in prompts],
                                    "max_tokens": [p.max_tokens for p in params]}) + "\\n")
            if os.environ.get("FAKE_VLLM_FAIL"):
                raise SystemExit(3)
            return [SimpleNamespace(prompt_token_ids=p["prompt_token_ids"],
                                    outputs=[SimpleNamespace(token_ids=[7] * s.max_tokens)])
                    for p, s in zip(prompts, params)]
''')
ARGS = ["bench", "throughput", "--model", "builtin:tiny", "--num-prompts", "3", "--input-len", "8",
        "--output-len", "4", "--range-ratio", "0.5", "--max-num-seqs", "8", "--dtype", "float32",
        "--backend", "vllm", "--vllm-python", sys.executable]


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("FAKE_VLLM_LOG", str(tmp_path / "calls.jsonl"))
    return tmp_path / "calls.jsonl"


def test_vllm_runs_the_same_workload_eager_and_compiled(fake_vllm, capsys):
    assert main([*ARGS, "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    calls = [json.loads(line) for line in fake_vllm.read_text().splitlines()]
    assert [r["backend"] for r in results] == ["vllm-eager", "vllm-compiled"]
    assert [c["settings"]["enforce_eager"] for c in calls] == [True, False]
    assert calls[0]["prompts"] == calls[1]["prompts"] and len(calls[0]["prompts"]) == 3
    assert results[0]["output_tokens"] == sum(calls[0]["max_tokens"])
    assert results[0]["prompt_tokens"] == sum(map(len, calls[0]["prompts"]))
    s = calls[0]["settings"]
    assert (s["dtype"], s["max_num_seqs"], s["enable_prefix_caching"]) == ("float32", 8, True)
    assert s["max_num_batched_tokens"] == 2048  # kvpilot's budget, not vLLM's own default
    assert calls[0]["cwd"] == "/" and calls[0]["kv_space"] == "2"


def test_the_prompts_are_kvpilots_own(fake_vllm, capsys):
    """kvpilot and vLLM get one workload: the same ids, in the same order."""
    assert main([*ARGS[:-4], "--backend", "kvpilot", "vllm", "--vllm-mode", "eager",
                 "--vllm-python", sys.executable]) == 0
    out = capsys.readouterr().out
    assert "vs kvpilot" in out and "vllm-eager" in out and "1.00x" in out
    from kvpilot.engine.bench.throughput import make_workload
    from types import SimpleNamespace
    workload = make_workload(SimpleNamespace(num_prompts=3, input_len=8, output_len=4, range_ratio=0.5),
                             4096, seed=0)
    call = json.loads(fake_vllm.read_text())
    assert call["prompts"] == [p for p, _ in workload] and call["max_tokens"] == [o for _, o in workload]


def test_a_failed_vllm_run_and_a_missing_interpreter_are_clear_errors(fake_vllm, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    assert main([*ARGS, "--vllm-mode", "eager"]) == 2
    assert "the vLLM run (eager) failed with exit status 3" in capsys.readouterr().err
    assert main(ARGS[:-2]) == 2
    assert "--backend vllm needs --vllm-python" in capsys.readouterr().err
