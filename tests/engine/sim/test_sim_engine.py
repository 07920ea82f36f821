"""The real engine with the simulated executor: deterministic tokens that honour the
request's limits, the real scheduler's preemption and prefix caching, modelled time on
a virtual clock, and an import path without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.core.clock import VirtualClock
from kvpilot.engine.config.engine import EngineConfig
from kvpilot.engine.llm_engine import LLMEngine

SIM = {"accelerator": "h100-80gb", "model": "llama-3.1-8b"}


def _llm(**kw) -> LLM:
    kw.setdefault("max_model_len", 4096)
    return LLM(model=None, simulate=dict(SIM, **kw.pop("sim", {})), **kw)


def test_the_simulated_engine_runs_without_torch():
    code = (
        "import sys\n"
        "from kvpilot.engine import LLM, SamplingParams\n"
        "llm = LLM(model=None, simulate={'accelerator': 'l4', 'model': 'llama-3.1-8b'}, max_model_len=2048)\n"
        "out = llm.generate(['hello'] * 3, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)\n"
        "assert [len(o.outputs[0].token_ids) for o in out] == [5, 5, 5]\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_limits_eos_min_tokens_and_stop_ids_are_honoured():
    llm = _llm(sim={"output_len": "fixed:7"})
    full = llm.generate(["a prompt"], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    assert len(full.outputs[0].token_ids) == 20 and full.outputs[0].finish_reason == "length"
    eos = llm.generate(["a prompt"], SamplingParams(max_tokens=20), use_tqdm=False)[0].outputs[0]
    assert len(eos.token_ids) == 7 and eos.finish_reason == "stop"
    assert eos.token_ids[-1] in llm.get_tokenizer().eos_token_ids
    assert eos.token_ids[:6] == full.outputs[0].token_ids[:6]  # EOS only replaces the 7th
    late = llm.generate(["a prompt"], SamplingParams(max_tokens=20, min_tokens=10), use_tqdm=False)[0]
    assert len(late.outputs[0].token_ids) == 11  # EOS moved past min_tokens
    stop_at = full.outputs[0].token_ids[3]
    stopped = llm.generate(["a prompt"], SamplingParams(max_tokens=20, ignore_eos=True,
                                                         stop_token_ids=[stop_at]), use_tqdm=False)[0]
    c = stopped.outputs[0]
    assert c.token_ids[-1] == stop_at and c.finish_reason == "stop" and c.stop_reason == stop_at
    assert len(c.token_ids) == full.outputs[0].token_ids.index(stop_at) + 1


def test_tokens_depend_on_the_request_not_on_the_batch_and_text_decodes():
    llm = _llm()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = llm.generate(["the same prompt"], params, use_tqdm=False)[0].outputs[0]
    batch = llm.generate(["other"] * 5 + ["the same prompt"] + ["x y z"] * 5, params, use_tqdm=False)
    assert batch[5].outputs[0].token_ids == alone.token_ids
    assert alone.text and alone.text == llm.get_tokenizer().decode(alone.token_ids)
    kids = llm.generate(["p"], SamplingParams(n=3, max_tokens=8, ignore_eos=True, seed=5), use_tqdm=False)[0]
    again = llm.generate(["p"], SamplingParams(n=3, max_tokens=8, ignore_eos=True, seed=5), use_tqdm=False)[0]
    ids = [c.token_ids for c in kids.outputs]
    assert len({tuple(x) for x in ids}) == 3 and ids == [c.token_ids for c in again.outputs]
    lp = llm.generate(["p"], SamplingParams(max_tokens=4, logprobs=3, ignore_eos=True), use_tqdm=False)[0]
    rows = lp.outputs[0].logprobs
    assert len(rows) == 4 and all(r.logprob <= 0 and len(r.top) == 3 for r in rows)


def test_preemption_by_recompute_costs_modelled_time_and_keeps_tokens():
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    prompts = [[100 + i] * 600 for i in range(12)]

    def run(kv_bytes):
        clock = VirtualClock()
        engine = LLMEngine(EngineConfig(model=None, simulate=dict(SIM), max_model_len=1024,
                                        kv_cache_memory=kv_bytes, max_num_seqs=12), clock)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        return done, engine.scheduler.num_preemptions, clock.t, engine.runner.busy_s

    roomy, p0, t0, busy0 = run(8 * 2**30)
    tight, p1, t1, busy1 = run(12 * 800 // 2 * 2**17)  # half the tokens the batch needs
    assert p0 == 0 and p1 > 0
    assert tight == roomy  # recompute changes the timing, never the tokens
    assert t1 > t0  # evicted sequences are prefilled again: real, modelled cost
    assert t0 == pytest.approx(busy0) and t1 == pytest.approx(busy1)  # no idle gaps on this clock


def test_prefix_cache_hits_shorten_the_modelled_prefill():
    clock = VirtualClock()
    engine = LLMEngine(EngineConfig(model=None, simulate=dict(SIM), max_model_len=8192), clock)
    prefix = list(range(1000, 5000))
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    def ttft(rid, prompt):
        start = clock.t
        engine.add_request(rid, prompt, params, arrival_time=start)
        while engine.has_unfinished_requests():
            engine.step()
        return clock.t - start

    miss = ttft("a", prefix + [7, 8, 9])
    hit = ttft("b", prefix + [9, 8, 7])
    assert engine.kv_cache.prefix_stats.hits >= 3984
    assert hit < miss / 5


def test_detokenize_false_and_final_only_outputs():
    engine = LLMEngine(EngineConfig(model=None, simulate=dict(SIM), max_model_len=2048), VirtualClock())
    engine.add_request("q", [5] * 10, SamplingParams(max_tokens=6, ignore_eos=True, detokenize=False,
                                                      output_kind="final_only"))
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    assert len(seen) == 1 and seen[0].finished
    assert seen[0].outputs[0].text == "" and len(seen[0].outputs[0].token_ids) == 6
    with pytest.raises(ValueError, match="stop strings need detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="sometimes")


def test_a_request_carries_its_service_tier_to_the_latency_sink():
    engine = LLMEngine(EngineConfig(model=None, simulate=dict(SIM), max_model_len=2048), VirtualClock())
    finished = []

    class Sink:
        def record_first_token(self, ttft): pass
        def record_inter_token(self, latency): pass
        def record_iteration_tokens(self, num_tokens): pass
        def record_finished(self, req): finished.append(req)

    engine.latency_sink = Sink()
    params = SamplingParams(max_tokens=3, ignore_eos=True, detokenize=False)
    engine.add_request("batch", [5] * 10, params, service_tier="flex")
    engine.add_request("chat", [6] * 10, params)
    with pytest.raises(ValueError, match=r"service_tier must be one of \['default', 'flex', 'priority'\]"):
        engine.add_request("bad", [7] * 10, params, service_tier="auto")  # the server maps auto first
    while engine.has_unfinished_requests():
        engine.step()
    assert sorted(r.service_tier for r in finished) == ["default", "flex"]


def test_model_loading_takes_its_simulated_time_on_the_engine_clock():
    clock = VirtualClock()
    LLMEngine(EngineConfig(model=None, simulate={**SIM, "load_seconds": 55}), clock)
    assert clock.now() == 55.0


def test_simulate_config_errors_name_the_field():
    with pytest.raises(ValueError, match="simulate_model: name a model shape"):
        EngineConfig(model=None, simulate={"accelerator": "h100-80gb"})
    with pytest.raises(ValueError, match="simulate_output_len"):
        EngineConfig(model=None, simulate={**SIM, "output_len": "normal:3"})
    with pytest.raises(ValueError, match="simulate_memory"):
        EngineConfig(model=None, simulate={**SIM, "memory": "lots"})
    with pytest.raises(ValueError, match="simulate_load_seconds"):
        EngineConfig(model=None, simulate={**SIM, "load_seconds": -2})
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLMEngine(EngineConfig(model=None, simulate={**SIM, "model": "mistral-7b"}, max_model_len=65536),
                  VirtualClock())
    with pytest.raises(ValueError, match="KV cache holds .* but max_model_len is 131072"):
        LLMEngine(EngineConfig(model=None, simulate={"accelerator": "l4", "model": "llama-3.1-8b"}),
                  VirtualClock())
