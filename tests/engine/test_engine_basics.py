"""Engine configuration errors, start-up capacity check, live limits, the CLI."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from kvpilot.engine import LLM, EngineConfig, SamplingParams
from kvpilot.engine.config.quantity import parse_bytes
from kvpilot.engine.config.validation import LengthError, RequestError, token_ids

TINY_KV_BYTES_PER_TOKEN = 4 * 1024  # builtin:tiny in float32, fixed by ARCHITECTURE.md


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=-1), "max_num_batched_tokens"),
        (dict(block_size=7), "block_size"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(kv_cache_memory="lots"), "kv_cache_memory"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(dtype="int3"), "dtype"),
        (dict(attention_backend="cuda-magic"), "attention_backend"),
    ],
)
def test_engine_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="builtin:tiny", **kwargs)


@pytest.mark.parametrize("ids, bad", [([], "must not be empty"), ([1, 2, 99], "got 99"),
                                      ([1, -1], "got -1"), ([1, True], "got True"),
                                      ([1, 2.0], "got 2.0"), ([1, "2"], "got '2'")])
def test_token_id_prompts_have_one_validator(ids, bad):
    with pytest.raises(ValueError, match=f"prompt token ids .*{bad}"):
        token_ids("prompt token ids", ids, vocab_size=99)
    assert token_ids("p", [0, 98], vocab_size=99) == [0, 98]


def test_quantities():
    assert parse_bytes("x", "64Mi") == 64 * 2**20
    assert parse_bytes("x", "1G") == 10**9
    assert parse_bytes("x", 4096) == 4096
    assert parse_bytes("x", "64Ki") == 64 * 2**10 and parse_bytes("x", "2k") == 2000
    for bad in ("64ki", "1KB", "1 Mib"):  # "ki" once matched the pattern and then raised KeyError
        with pytest.raises(ValueError, match="x must be a byte count"):
            parse_bytes("x", bad)


def test_kv_cache_too_small_for_max_model_len_names_both_numbers():
    with pytest.raises(ValueError, match=r"holds 256 tokens but max_model_len is 1024.*Lower max_model_len"):
        LLM(model="builtin:tiny", dtype="float32", max_model_len=1024,
            kv_cache_memory=256 * TINY_KV_BYTES_PER_TOKEN)


@pytest.fixture(scope="module")
def llm():
    return LLM(model="builtin:tiny", dtype="float32", max_model_len=512,
               kv_cache_memory=2048 * TINY_KV_BYTES_PER_TOKEN)


def test_tiny_model_kv_arithmetic(llm):
    assert llm.engine.kv_capacity_tokens == 2048
    assert llm.engine.kv_bytes_per_token == TINY_KV_BYTES_PER_TOKEN


def test_live_limits_validate_and_apply(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="max_model_len"):
        engine.update_limits(max_num_seqs=3, max_model_len=4096)  # over the KV capacity
    assert engine.max_num_seqs == 256, "a rejected update changes nothing"
    engine.update_limits(max_num_seqs=2, max_model_len=256)
    assert (engine.max_num_seqs, engine.max_model_len) == (2, 256)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[11] * 250], SamplingParams(max_tokens=10), use_tqdm=False)
    outs = llm.generate(["a", "b", "c", "d"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    engine.update_limits(max_num_seqs=256, max_model_len=512)


@pytest.mark.parametrize("prompt, params, param, kind, message", [
    ([1, 2, 99999], {}, "prompt", RequestError, "prompt token ids must be integers"),
    ("", {}, "prompt", RequestError, "prompt must not be empty"),
    ([11] * 500, {"max_tokens": 20}, "max_tokens", LengthError, "exceeds max_model_len (512)"),
    ([11] * 512, {"max_tokens": None}, "prompt", LengthError, "leaves no room under max_model_len"),
])
def test_the_engine_edge_names_the_refused_field(llm, prompt, params, param, kind, message):
    """add_request is the one place a request is checked and max_tokens resolved, for the
    offline LLM and the server alike: its error says which field (the server's 400 param)."""
    with pytest.raises(kind, match=re.escape(message)) as e:
        llm.engine.add_request("edge", prompt, SamplingParams(**params))
    assert e.value.param == param and isinstance(e.value, ValueError)
    assert not llm.engine.has_unfinished_requests()


def test_the_engine_edge_checks_ids_and_tiers_once(llm):
    engine = llm.engine
    engine.add_request("twice", [11, 12], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="request_id 'twice' is already in use") as e:
        engine.add_request("twice", [11, 12], SamplingParams(max_tokens=2))
    assert e.value.param == "request_id"
    with pytest.raises(RequestError, match="service_tier must be one of") as e:
        engine.add_request("tier", [11], SamplingParams(max_tokens=2), service_tier="cheap")
    assert e.value.param == "service_tier"
    engine.abort_request("twice")
    assert not engine.has_unfinished_requests()


def test_multibyte_text_round_trips(llm):
    out = llm.generate(["héllo wörld — 日本語 🚀"], SamplingParams(max_tokens=16, temperature=1.0, seed=3),
                       use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)


def test_generate_cli_json():
    proc = subprocess.run(
        [sys.executable, "-m", "kvpilot.engine.cli", "generate", "--model", "builtin:tiny",
         "--prompt", "Hello", "--max-tokens", "5", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["prompt"] == "Hello" and len(result["token_ids"]) <= 5


def test_cli_reports_bad_input_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "kvpilot.engine.cli", "generate", "--model", "/nonexistent",
         "--prompt", "x"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "model" in proc.stderr and "Traceback" not in proc.stderr
