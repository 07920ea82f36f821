"""Quantize at load (--quantization int8|int4): the engine serves exactly the network whose
float weights are its dequantized integer weights, holds about 1/2 (int8) or 1/4 (int4) of
a 16-bit model's bytes in the decoder's linears, and refuses bad input by name."""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.attention.layer import PagedAttention
from kvpilot.engine.config.engine import EngineConfig
from kvpilot.engine.config.args import add_engine_args, engine_config_from_args
from kvpilot.engine.config.model import ModelConfig
from kvpilot.engine.models.llama import LlamaForCausalLM
from kvpilot.engine.quant.linear import QuantizedLinear
from kvpilot.kernels.quant_pack import dequantize, quantize_rtn
from kvpilot.engine.quant.quantize import DECODER_LINEARS, SCHEMES, quantize_decoder, quantize_linear, weight_bytes
from kvpilot.engine.loader.weights import iter_safetensors

MAX_NEW = 12
METHODS = ("int8", "int4")
# Chunked prefill (8-token chunks) and prefix caching both at work.
ENGINE_ARGS = dict(dtype="float32", enable_prefix_caching=True, max_num_batched_tokens=8, kv_cache_memory="16Mi")


def shared_prefix_prompts() -> list[list[int]]:
    """Four prompts, two sharing a 33-token prefix (prefix-cache hits under chunked prefill)."""
    rng = random.Random(0)
    shared = [rng.randrange(10, 1000) for _ in range(33)]  # two full 16-token blocks and one more
    return [[rng.randrange(10, 1000) for _ in range(5)],
            shared + [rng.randrange(10, 1000) for _ in range(4)],
            [rng.randrange(10, 1000) for _ in range(21)],
            shared + [rng.randrange(10, 1000) for _ in range(7)]]


@pytest.fixture(scope="module")
def prompts():
    return shared_prefix_prompts()


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    # The shared prefix's second request runs after the first has cached its blocks.
    outs = llm.generate(prompts[:2], params, use_tqdm=False) + llm.generate(prompts[2:], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _write_twin(llm: LLM, model_dir, twin_dir) -> None:
    """A float checkpoint whose decoder linears are the engine's dequantized weights."""
    shutil.copytree(model_dir, twin_dir)
    tensors = dict(iter_safetensors(model_dir))
    for i, layer in enumerate(llm.engine.runner.model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        splits = {"self_attn.qkv_proj": {"q_proj": attn.q_size, "k_proj": attn.kv_size, "v_proj": attn.kv_size},
                  "mlp.gate_up_proj": {"gate_proj": mlp.intermediate_size, "up_proj": mlp.intermediate_size},
                  "self_attn.o_proj": {"o_proj": None}, "mlp.down_proj": {"down_proj": None}}
        for path, parts in splits.items():
            module = layer.get_submodule(path)
            assert isinstance(module, QuantizedLinear)
            weight = dequantize(module.quantized(), torch.float32)  # [N, K]
            start, parent = 0, path.split(".")[0]
            for proj, rows in parts.items():
                rows = rows or weight.shape[0]
                name = f"model.layers.{i}.{parent}.{proj}.weight"
                assert tensors[name].shape == weight[start:start + rows].shape
                tensors[name] = weight[start:start + rows].contiguous()
                start += rows
    (twin_dir / "model.safetensors").unlink()
    save_file(tensors, str(twin_dir / "model.safetensors"))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ["llama", "qwen2-bias"])
def test_quantized_engine_equals_its_dequantized_float_twin(method, arch, tiny_model_dir, tiny_qwen2_dir,
                                                           prompts, tmp_path):
    model_dir = tiny_model_dir if arch == "llama" else tiny_qwen2_dir
    quantized = LLM(model=str(model_dir), quantization=method, **ENGINE_ARGS)
    _write_twin(quantized, model_dir, tmp_path / "twin")
    twin = LLM(model=str(tmp_path / "twin"), **ENGINE_ARGS)
    got = _greedy(quantized, prompts)
    assert got == _greedy(twin, prompts)
    assert quantized.engine.stats().prefix_cache_hits_total >= 32
    runner = quantized.engine.runner
    assert runner.quantization.layers == 4 * ModelConfig.from_dir(model_dir).num_hidden_layers
    assert f"{method} weights in" in runner.describe()
    assert quantized.engine.weight_bytes < twin.engine.weight_bytes


def _bf16_model(model_dir) -> LlamaForCausalLM:
    cfg = ModelConfig.from_dir(model_dir)
    model = LlamaForCausalLM.build(cfg, PagedAttention("torch"), cfg.max_position_embeddings,
                                   torch.bfloat16, torch.device("cpu"))
    model.load_weights(iter_safetensors(model_dir))
    return model


def _linear_bytes(model) -> int:
    """Parameters and buffers of the decoder layers' linears."""
    mods = [layer.get_submodule(p) for layer in model.model.layers for p in DECODER_LINEARS]
    return sum(t.numel() * t.element_size() for m in mods for t in (*m.parameters(), *m.buffers()))


def _expected_bytes(model, method) -> int:
    """Packed integers plus bf16 scales and zeros, per the scheme's group rule."""
    scheme, total = SCHEMES[method], 0
    for layer in model.model.layers:
        for p in DECODER_LINEARS:
            n, k = layer.get_submodule(p).weight.shape
            groups = -(-k // (scheme.group_for(k) or k))
            total += k * n * scheme.bits // 8 + 2 * groups * n * 2
    return total


@pytest.mark.parametrize("method,low,high", [("int8", 0.49, 0.52), ("int4", 0.24, 0.33)])
def test_resident_bytes_are_a_half_or_a_quarter_of_bf16(method, low, high, tiny_model_dir):
    model = _bf16_model(tiny_model_dir)
    float_linears, float_total = _linear_bytes(model), weight_bytes(model)
    expected = _expected_bytes(model, method)
    summary = quantize_decoder(model, method)
    assert not [m for layer in model.model.layers for m in layer.modules() if isinstance(m, nn.Linear)]
    linears = _linear_bytes(model)
    assert (summary.float_bytes, summary.quantized_bytes) == (float_linears, linears)
    assert linears == expected
    assert low < linears / float_linears < high
    # The rest of the model (embedding, LM head, norms) stays bf16.
    assert weight_bytes(model) == float_total - float_linears + linears


def test_int4_group_size_rule():
    int4, int8 = SCHEMES["int4"], SCHEMES["int8"]
    assert [int4.group_for(k) for k in (4096, 14336, 256, 384, 688, 96, 8)] == [128, 128, 128, 128, 16, 32, 8]
    assert int8.group_for(688) is None  # per channel


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_cpu_forward_is_f_linear_of_the_dequantized_weight(method, dtype):
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=True).to(dtype)
    layer = quantize_linear(linear, method)
    for shape in ((5, 256), (2, 3, 256)):
        x = torch.randn(shape, dtype=dtype)
        out = layer(x)
        assert out.shape == (*shape[:-1], 96) and out.dtype == dtype
        assert torch.equal(out, F.linear(x, dequantize(layer.quantized(), dtype), linear.bias.detach()))
    # And near the float layer it replaces (round-to-nearest error only).
    x = torch.randn(64, 256, dtype=dtype)
    ref = linear(x).float()
    err = (layer(x).float() - ref).norm() / ref.norm()
    assert err < {"int8": 0.02, "int4": 0.15}[method]


@pytest.mark.parametrize("method", METHODS)
def test_quantized_linear_gemm_path_equals_the_cpu_path(method):
    """The Triton GEMM's call (CUDA's path; Triton's interpreter here) against the CPU's."""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    layer = quantize_linear(nn.Linear(256, 96, bias=True), method)
    x = torch.randn(2, 3, 256)
    torch.testing.assert_close(layer.forward_gemm(x), layer(x), rtol=1e-4, atol=1e-4)
    if torch.cuda.is_available():
        layer, x16 = layer.to("cuda", torch.bfloat16), x.to("cuda", torch.bfloat16)
        ref = F.linear(x16, dequantize(layer.quantized(), torch.bfloat16), layer.bias).float()
        assert (layer(x16).float() - ref).norm() / ref.norm() < 1e-2


def test_quantization_choices_are_refused_by_name():
    with pytest.raises(ValueError, match=r"quantization must be one of \('int8', 'int4', 'compressed-tensors', 'gptq', 'awq'\).*'int3'"):
        EngineConfig(model="builtin:tiny", quantization="int3")
    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--quantization", "int3"])
    assert engine_config_from_args(p.parse_args(["--model", "m", "--quantization", "int4"])).quantization == "int4"
    with pytest.raises(ValueError, match=r"quantization='int4': .*in_features=12: must be a multiple of 8"):
        quantize_linear(nn.Linear(12, 4), "int4")


def test_a_quantized_checkpoint_is_refused_with_or_without_the_flag(tiny_model_dir, tmp_path):
    folder = tmp_path / "bnb"
    shutil.copytree(tiny_model_dir, folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"quantization='int8' .*quantization_config \(quant_method='bitsandbytes'\)"):
        LLM(model=str(folder), quantization="int8")
    with pytest.raises(ValueError, match=r"config.json: quantization_config \(quant_method='bitsandbytes'\): "
                                         r"this quantized format is not read .*--quantization int8 or int4"):
        LLM(model=str(folder))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_per_channel_is_held_as_int8_on_the_cpu(dtype):
    """Per-channel symmetric int8 on the CPU is held as int8 [K, N] (the packed layout's
    bytes) and dequantized with one multiply: the same outputs as the packed path, bit for
    bit, and the packed layout comes back bit for bit."""
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(256, 96, bias=True).to(dtype)
    packed = quantize_rtn(linear.weight.detach(), 8, None, symmetric=True)
    layer = quantize_linear(linear, "int8")
    assert layer.int8_weight is not None and layer.qweight is None
    assert layer.int8_weight.dtype == torch.int8 and tuple(layer.int8_weight.shape) == (256, 96)
    assert layer.nbytes() == QuantizedLinear(packed, linear.bias.detach()).nbytes()
    assert torch.equal(layer.quantized().qweight, packed.qweight)
    x = torch.randn(7, 256, generator=gen).to(dtype)
    weight = dequantize(packed, dtype)  # [N, K]
    assert torch.equal((layer.int8_weight.to(dtype) * layer.scales[0].to(dtype)).t(), weight)
    assert torch.equal(layer(x), F.linear(x, weight, layer.bias))
    assert quantize_linear(linear, "int4").int8_weight is None  # zero points and groups: unpacked
