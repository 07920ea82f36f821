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
    from kvpilot.kernels.check.compile import QUANT_VARIANTS

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvpilot.kernels.check.compile", "--arch", "90", "--json"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads(proc.stdout)
    assert {r["kernel"] for r in rows} == {
        "_paged_decode_kernel", "_merge_splits_kernel", "_paged_prefill_kernel", "_write_kv_cache_kernel",
        "_quant_matmul_kernel",
    }
    # Every integer-weight GEMM variant (formerly also compiled on its own by
    # test_kernels_quant_gemm.py::test_quant_gemm_compiles_for_hopper, a second ptxas run).
    assert sum(r["kernel"] == "_quant_matmul_kernel" for r in rows) == len(QUANT_VARIANTS)
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

    from kvpilot.kernels.check.graphs import format_graphs, run_decode_graphs

    result = run_decode_graphs(
        50.0, time.monotonic() + 300, layers=2,
        model_shape={"hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 512},
        dtype="float32", device="cpu", batches=(1, 3), prompt_len=8, decode_tokens=5,
        llm_kwargs={"attention_backend": "torch", "kv_cache_memory": "16Mi"})
    assert "error" not in result, result.get("traceback")
    assert result["modes"] == ["graphs", "int8", "int4", "fp8-kv", "eager"]
    for mode in result["modes"]:
        assert result[mode]["cuda_graphs"] is False
        for b in (1, 3):
            row = result[mode][f"batch_{b}"]
            assert row["decode_tok_per_s"] > 0 and 0 < row["frac_of_roofline"]
            assert ("vs_graphs" in row) == (mode != "graphs")
    # Quantized weights: fewer bytes, so a higher roofline; the fp8 cache leaves weights alone.
    weights = {mode: result[mode]["weight_bytes"] for mode in result["modes"]}
    assert weights["int4"] < weights["int8"] < weights["graphs"] == weights["fp8-kv"]
    table = format_graphs(result)
    assert any("b=3" in line for line in table) and any(line.strip().startswith("int4") for line in table)


def test_gpu_check_speculative_part_runs_on_a_tiny_cpu_model():
    """The speculative-decoding part end to end on tiny models on the CPU, so its first GPU
    run is not its first run: every method runs, and speculation keeps the greedy tokens."""
    import time

    from kvpilot.kernels.check.spec import format_speculative, run_speculative

    tiny = {"hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 512}
    result = run_speculative(
        time.monotonic() + 300, layers=2, draft_layers=1, target_shape=tiny, draft_shape=dict(tiny, hidden=32),
        k=3, dtype="float32", device="cpu", prompt_len=32, decode_tokens=12,
        llm_kwargs={"attention_backend": "torch", "kv_cache_memory": "16Mi"})
    assert "error" not in result, result.get("traceback")
    for name in ("none", "ngram", "draft"):
        assert result[name]["decode_tok_per_s"] > 0
    for name in ("ngram", "draft"):
        assert result[name]["same_tokens"] and result[name]["draft_tokens"] > 0
    lines = format_speculative(result)
    assert any(line.strip().startswith("draft") and "x" in line for line in lines)


def test_gpu_check_parallel_part_runs_on_a_tiny_cpu_model():
    """The tensor-parallel part on the CPU: the multi-process code path with one rank (a
    gloo group of 1 here, NCCL on the GPU) gives the plain engine's greedy tokens and reads
    the whole checkpoint once."""
    import time

    from kvpilot.kernels.check.parallel import format_parallel, run_parallel

    tiny = {"hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 512}
    result = run_parallel(time.monotonic() + 300, layers=2, shape=tiny, dtype="float32", device="cpu",
                          prompt_len=32, decode_tokens=12, llm_kwargs={"kv_cache_memory": "16Mi"})
    assert "error" not in result, result.get("traceback")
    assert result["same_tokens"], result
    assert "1 ranks (tensor parallel 1 x pipeline 1, gloo)" in result["parallel_executor_world_1"]["describe"]  # 1 rank: no shm
    read = result["parallel_executor_world_1"]["load_bytes_read"]
    assert result["checkpoint_bytes"] <= read < result["checkpoint_bytes"] * 1.01
    assert any("greedy tokens equal" in line for line in format_parallel(result))


def test_gpu_check_quant_part_runs_on_the_cpu_interpreter():
    """The quant GEMM part's plumbing (weights, correctness first, timing, rows, table) on
    tiny shapes under the interpreter with a plain timer, so its first GPU run is not its
    first run."""
    import time

    from kvpilot.kernels.check.quant import format_quant_gemm, run_quant_gemm

    def timer_ms(fn):
        start = time.perf_counter()
        fn()
        return max((time.perf_counter() - start) * 1e3, 1e-6)

    result = run_quant_gemm(time.monotonic() + 300, device="cpu", layers=(("tiny 512->40", 512, 40),),
                            schemes=(("int4 g32", 4, 32), ("int8 per-channel", 8, None)), batches=(1, 3),
                            copy_gb_per_s=100.0, bench_ms=timer_ms)
    assert "error" not in result, result.get("traceback")
    assert result["all_correct"] is True and len(result["rows"]) == 4
    for row in result["rows"]:
        assert row["ok"] and row["rel_err"] <= result["rtol"]
        assert row["ms"] > 0 and row["cublas_ms"] > 0 and row["tflops"] > 0 and row["gb_per_s"] > 0
        assert row["speedup_vs_cublas"] == row["cublas_ms"] / row["ms"] and "frac_of_copy" in row
        # One "SM" on the CPU: no split chosen; 2 and 4 slices of the 4 K tiles timed beside it.
        assert row["split_k"] == 1 and set(row["ms_by_split_k"]) == {2, 4}
    assert {r["group_size"] for r in result["rows"]} == {32, 512}  # per-channel: group_size = K
    lines = format_quant_gemm(result)
    assert "4/4 points within" in lines[0] and sum("int8 per-channel" in line for line in lines) == 2
    assert sum("other split_k (us): 2:" in line for line in lines) == 4

    late = run_quant_gemm(time.monotonic() - 1, device="cpu", layers=(("tiny", 64, 40),), batches=(1, 3))
    assert [r["skipped"] for r in late["rows"]] == ["out of time budget"] * 4  # 2 schemes x 2 batches
    assert late["all_correct"] is True


def test_gpu_check_quant_rows_render_in_the_table():
    from kvpilot.kernels.gpu_check import format_table

    row = {"scheme": "int4 g128", "layer": "mlp_up 4096->14336", "m": 1, "ok": True, "rel_err": 1e-4,
           "ms": 0.012, "tflops": 9.8, "gb_per_s": 2500.0, "cublas_ms": 0.036, "speedup_vs_cublas": 3.0}
    quant = {"dtype": "float16", "rtol": 1e-3, "all_correct": False, "rows": [
        row,
        {**row, "m": 16, "ok": False, "rel_err": 0.5, "ms": None},
        {"scheme": "int8 per-channel", "layer": "attn_o 4096->4096", "m": 256, "skipped": "out of time budget"},
    ]}
    del quant["rows"][1]["ms"]
    results = {"device": "NVIDIA H200", "mode": "gpu", "elapsed_s": 10.0, "out": "/tmp/r.json", "correctness": [],
               "quant_gemm": quant}
    table = format_table(results)
    for text in ("quant GEMM (float16", "1/2 points within rel err 1e-03", "12.0", "2500", "3.00x",
                 "FAILED rel err 5.0e-01", "out of time budget"):
        assert text in table, text
    assert "quant GEMM: skipped (out of time budget)" in format_table({**results, "quant_gemm": {
        "skipped": "out of time budget"}})
