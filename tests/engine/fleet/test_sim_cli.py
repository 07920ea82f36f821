"""`kvpilot sim` and the simulate flags on the command line: a short run with its plot
and scrapes, a written trace, describe, and clear errors for bad input."""

from __future__ import annotations

import json

from kvpilot.engine.cli import main


def test_sim_run_prints_simulated_figures_and_writes_its_outputs(tmp_path, capsys):
    out, plot, scrapes = tmp_path / "r.json", tmp_path / "p.png", tmp_path / "s.jsonl"
    code = main(["sim", "run", "--simulate", "l4", "--simulate-model", "llama-3.1-8b", "--max-model-len", "4096",
                 "--phase", "duration=30 rate=2 input=uniform:100:800 output=fixed:50", "--replicas", "2",
                 "--goodput", "ttft:2000", "tpot:100", "--save-result", str(out), "--plot", str(plot),
                 "--save-scrapes", str(scrapes), "--disable-tqdm"])
    text = capsys.readouterr().out
    assert code == 0
    assert "SIMULATED accelerator: l4 x2" in text and "Request goodput (req/s):" in text
    result = json.loads(out.read_text())
    assert result["simulated"] and result["completed"] > 30 and result["total_output_tokens"] == 50 * result["completed"]
    assert plot.stat().st_size > 1000
    first = json.loads(scrapes.read_text().splitlines()[0])
    assert {s[0] for s in first["samples"]} >= {"vllm:num_requests_running", "kvpilot:simulated_info"}


def test_sim_trace_then_run_from_the_file(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    assert main(["sim", "trace", "--phase", "duration=10 rate=3", "--out", str(trace), "--max-len", "2048"]) == 0
    assert main(["sim", "run", "--simulate", "a100-80gb", "--simulate-model", "qwen2.5-7b", "--max-model-len",
                 "2048", "--trace", str(trace), "--max-concurrency", "4", "--disable-tqdm", "--json"]) == 0
    text = capsys.readouterr().out
    result = json.loads(text[text.index("{"):])
    assert result["completed"] == len(trace.read_text().splitlines())


def test_describe_shows_the_memory_plan(capsys):
    assert main(["sim", "describe", "--simulate", "h100-80gb", "--simulate-model", "llama-3.1-8b",
                 "--max-model-len", "8192"]) == 0
    text = capsys.readouterr().out
    assert "KV cache: 453632 tokens" in text and "decode batch 256, context 2048" in text


def test_bad_input_is_one_clear_line(tmp_path, capsys):
    cases = [
        (["serve", "--simulate", "h1000", "--simulate-model", "llama-3.1-8b"], "unknown accelerator 'h1000'"),
        (["serve", "--simulate-model", "llama-3.1-8b"], "--simulate-model need --simulate ACCELERATOR"),
        (["sim", "describe", "--simulate", "h100-80gb", "--simulate-model", "llama-3.1-70b",
          "--max-model-len", "4096"], "does not fit one accelerator"),
        (["sim", "run", "--simulate", "l4", "--simulate-model", "llama-3.1-8b", "--max-model-len", "2048",
          "--trace", str(tmp_path / "none.jsonl")], "trace: cannot read"),
        (["sim", "run", "--simulate", "l4", "--simulate-model", "llama-3.1-8b", "--max-model-len", "2048",
          "--phase", "rate=2"], "needs duration="),
        (["serve", "--model", "builtin:tiny", "--cpu-threads", "0"], "cpu_threads must be"),
        (["sim", "run", "--simulate", "l4", "--simulate-model", "llama-3.1-8b", "--max-model-len", "2048",
          "--phase", "duration=10 rate=0"], "generate no requests"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)


def test_autotune_simulate_decides_in_virtual_time(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(["autotune", "simulate", "--simulate", "h100-80gb", "--simulate-model", "llama-3.1-8b",
                 "--max-model-len", "8192", "--max-num-seqs", "8", "--max-num-batched-tokens", "8192",
                 "--phase", "duration=120 rate=10 input=uniform:200:2000 output=uniform:100:400",
                 "--interval", "10s", "--window", "20s", "--cooldown", "20s", "--max-num-seqs-bounds", "4:256",
                 "--max-model-len-bounds", "1024:8192", "--scrape-interval", "5", "--save-result", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    assert "SchedulerBound  change max_num_seqs 8->12" in text and "Autotuner changes applied:" in text
    result = json.loads(out.read_text())
    raises = [d["change"]["max_num_seqs"] for d in result["decisions"] if d["applied"]]
    assert raises and all(b > a for a, b in raises)
    assert main(["autotune", "simulate", "--simulate", "l4", "--simulate-model", "llama-3.1-8b",
                 "--max-model-len", "2048", "--phase", "duration=10 rate=1", "--replicas-bounds", "3:1"]) == 2
    assert "replicas_bounds takes MIN:MAX" in capsys.readouterr().err
