"""`kvpilot bench quantization` end to end on the tiny model (small sizes): one row per
method, float first; the quantized rows hold fewer weight bytes; float agrees with itself;
the perplexity path scores the same dequantized weights the engine computes with."""
from __future__ import annotations

import torch

from kvpilot.engine.bench.quantization import _scheme_weights, heldout_perplexity
from kvpilot.engine.cli import main
from kvpilot.engine.loader.source import resolve_model
from kvpilot.kernels.quant_pack import dequantize, quantize_rtn


def test_bench_quantization_prints_one_row_per_method(capsys):
    # A smoke of the benchmark: the smallest run that still fills every column (int4 decodes
    # at ~1 token/s on a busy CPU, so each output token counts).
    rc = main(["bench", "quantization", "--model", "builtin:tiny", "--batch-sizes", "1", "2", "--waves", "1",
               "--prompt-tokens", "8", "--output-len", "3", "--agreement-prompts", "1",
               "--ppl-seq-len", "16", "--ppl-tokens", "64", "--kv-cache-memory", "16Mi"])
    assert rc == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in out[1:5]}
    assert list(rows) == ["none", "int8", "int4", "fp8-kv"]
    fp32 = {m: float(r[1].removesuffix("MiB")) for m, r in rows.items()}
    assert fp32["int4"] < fp32["int8"] < fp32["none"] == fp32["fp8-kv"]
    assert rows["none"][3] == "1.00x" and rows["none"][6] == "100%"
    kv_tokens = {m: int(r[4]) for m, r in rows.items()}
    assert kv_tokens["fp8-kv"] == 4 * kv_tokens["none"] == 4 * kv_tokens["int8"]  # float32 cache -> 1 byte
    assert all(float(r[5]) > 1.0 for r in rows.values())  # a perplexity for each


def test_scheme_weights_replace_only_decoder_linears():
    torch.manual_seed(0)
    ckpt = {"model.embed_tokens.weight": torch.randn(32, 16), "model.layers.0.mlp.down_proj.weight": torch.randn(16, 64),
            "model.layers.0.input_layernorm.weight": torch.randn(16)}
    out = _scheme_weights("int8", ckpt)
    assert torch.equal(out["model.embed_tokens.weight"], ckpt["model.embed_tokens.weight"])
    assert torch.equal(out["model.layers.0.input_layernorm.weight"], ckpt["model.layers.0.input_layernorm.weight"])
    expected = dequantize(quantize_rtn(ckpt["model.layers.0.mlp.down_proj.weight"], 8, None, True))
    assert torch.equal(out["model.layers.0.mlp.down_proj.weight"], expected)


def test_quantized_perplexity_is_close_to_float_on_int8_and_fp8_kv():
    model_dir = resolve_model("builtin:tiny")
    base = heldout_perplexity(model_dir, "none", 32, 400)
    int8 = heldout_perplexity(model_dir, "int8", 32, 400)
    fp8 = heldout_perplexity(model_dir, "fp8-kv", 32, 400)
    assert abs(int8 - base) / base < 0.05, (base, int8)
    assert fp8 != base and abs(fp8 - base) / base < 0.05, (base, fp8)  # K/V went through e4m3
