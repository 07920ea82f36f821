"""The GPU check's CPU path, and an offline compile of every kernel for Hopper.

Neither needs a GPU: the first runs gpu_check's correctness part under the Triton
interpreter on small shapes; the second compiles the kernels for sm_90 down to a
cubin with Triton's bundled ptxas (what the interpreter cannot catch: non-constexpr
globals, unsupported dot shapes, register spills).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402


def test_gpu_check_cpu_path_writes_results_and_table(tmp_path, capsys):
    from kvpilot.kernels import gpu_check

    out = tmp_path / "results.json"
    assert gpu_check.main(["--cpu", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["mode"] == "cpu-interpreter"
    assert results["all_correct"] is True
    kernels = {row["kernel"] for row in results["correctness"]}
    assert kernels == {"decode", "prefill", "write"}
    assert all(row["ok"] for row in results["correctness"])
    assert "skipped" in results["timing"]
    table = capsys.readouterr().out
    assert "correctness:" in table and table.rstrip().endswith(str(out.absolute()))


def test_gpu_check_table_formats_gpu_results():
    """The GPU-only rows of the table render from a results dict (no GPU needed)."""
    from kvpilot.kernels.gpu_check import format_table

    results = {
        "device": "NVIDIA H200", "mode": "gpu", "elapsed_s": 200.0, "out": "/tmp/r.json",
        "correctness": [
            {"kernel": "decode", "dtype": "bfloat16", "ok": True, "kernel_vs_ref": 1e-3, "kernel_tol": 1e-2}
        ],
        "copy_bandwidth": {"gb_per_s": 4000.0},
        "decode": [
            {"batch": 1, "context": 512, "num_splits": 2, "ms": 0.01, "gb_per_s": 1000.0, "frac_of_copy": 0.25,
             "sdpa_ms": 0.02, "speedup_vs_sdpa": 2.0},
            {"batch": 256, "context": 8192, "skipped": "out of time budget"},
        ],
        "decode_config_sweep": [{"batch": 1, "context": 8192, "BLOCK_N": 64, "num_warps": 4, "ms": 0.1,
                                 "gb_per_s": 3000.0, "is_default": True}],
        "prefill": {"ms": 1.0, "tflops": 300.0, "sdpa_ms": 0.9, "speedup_vs_sdpa": 0.9},
        "graphs": {"model_shape": {"layers": 8}, "dtype": "bfloat16",
                   "graphs": {"capture_s": 3.5, "capture_mib": 120.0,
                              "batch_1": {"decode_tok_per_s": 210.0, "frac_of_roofline": 0.7}},
                   "eager": {"batch_1": {"decode_tok_per_s": 90.0, "frac_of_roofline": 0.3}}},
        "e2e": {"kvpilot_1": {"tok_per_s": 100.0}, "transformers_1": {"tok_per_s": 50.0, "first_token_match": 1.0}},
    }
    table = format_table(results)
    for text in ("4000 GB/s", "25%", "2.00x", "out of time budget", "tile sweep", "TFLOP/s", "kvpilot 100 tok/s",
                 "b=1 210 tok/s = 70% of roofline", "capture 3.5 s", "eager  b=1 90 tok/s"):
        assert text in table


def _has_ptxas() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return bool(get_ptxas(90).path)
    except Exception:
        return False


@pytest.mark.skipif(not _has_ptxas(), reason="triton's bundled ptxas is not available")
def test_every_kernel_compiles_for_hopper_without_spills_on_llama_shapes():
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvpilot.kernels.compile_check", "--arch", "90", "--json"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads(proc.stdout)
    assert {r["kernel"] for r in rows} == {
        "_paged_decode_kernel", "_merge_splits_kernel", "_paged_prefill_kernel", "_write_kv_cache_kernel"
    }
    for r in rows:
        assert r["ok"] and r["has_cubin"], r
        if r["dtype"] != "float32" and "spill_store_bytes" in r:
            assert r["spill_store_bytes"] == 0, f"register spills in {r}"


def test_gpu_check_end_to_end_part_runs_on_a_tiny_cpu_model(tmp_path):
    """The end-to-end part (make model, kvpilot LLM, transformers generate, agreement,
    step times for the simulator's calibration) on a tiny float32 model on the CPU, so
    its first GPU run is not its first run."""
    import time

    from kvpilot.engine.sim.steps import read_records
    from kvpilot.kernels.gpu_check import run_end_to_end

    result = run_end_to_end(
        8, 4, time.monotonic() + 300,
        model_shape={"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 512},
        dtype="float32", device="cpu", concurrency=(1, 3),
        llm_kwargs={"attention_backend": "torch", "kv_cache_memory": "16Mi"},
        steps_out=tmp_path / "steps.json", step_grids=("smoke",),
    )
    assert "error" not in result, result.get("traceback")
    records, meta = read_records(tmp_path / "steps.json")
    assert meta["config"]["hidden_size"] == 64 and {r.kind for r in records} >= {"decode", "prefill"}
    for n in (1, 3):
        assert result[f"kvpilot_{n}"]["output_tokens"] == 4 * n
        assert result[f"transformers_{n}"]["output_tokens"] == 4 * n
    # float32 on the CPU: greedy tokens agree with transformers.
    assert result["transformers_3"]["first_token_match"] == 1.0


def test_gpu_check_graphs_part_runs_on_a_tiny_cpu_model():
    """The CUDA-graph part end to end on a tiny model on the CPU (where both modes run
    eagerly and say so), so its first GPU run is not its first run."""
    import time

    from kvpilot.kernels.gpu_check_graphs import format_graphs, run_decode_graphs

    result = run_decode_graphs(
        50.0, time.monotonic() + 300, layers=2,
        model_shape={"hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 512},
        dtype="float32", device="cpu", batches=(1, 3), prompt_len=8, decode_tokens=5,
        llm_kwargs={"attention_backend": "torch", "kv_cache_memory": "16Mi"})
    assert "error" not in result, result.get("traceback")
    for mode in ("graphs", "eager"):
        assert result[mode]["cuda_graphs"] is False
        for b in (1, 3):
            row = result[mode][f"batch_{b}"]
            assert row["decode_tok_per_s"] > 0 and 0 < row["frac_of_roofline"]
    assert any("b=3" in line for line in format_graphs(result))
