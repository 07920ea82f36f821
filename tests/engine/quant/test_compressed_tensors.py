"""compressed-tensors checkpoints (vLLM's llm-compressor format, `pack-quantized` W4A16 and
W8A16): the engine reads the integers the library wrote bit for bit, serves exactly the
network of the library's own decompressed weights, holds the weights as integers, and
refuses at start-up, by name, what it does not read.

The checkpoints are made here, at test time, by the compressed-tensors library itself
(apply_quantization_config; its calculate_qparams on each group's min/max, i.e. round to
nearest without calibration data; then ModelCompressor.compress_model, save_pretrained and
update_config, the calls llm-compressor saves through), from the tiny float models."""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.config.model import ModelConfig
from kvpilot.engine.quant.compressed_tensors import parse
from kvpilot.engine.quant.checkpoint_load import FUSED_SOURCES as FUSED, convert
from kvpilot.engine.quant.linear import QuantizedLinear
from kvpilot.kernels.quant_pack import dequantize, unpack_along_k
from kvpilot.engine.loader.weights import iter_safetensors
# The same prompts (a shared prefix, chunked prefill) and engine settings as quantize-at-load's.
from test_quantization import ENGINE_ARGS, MAX_NEW, shared_prefix_prompts

pytest.importorskip("compressed_tensors")

# Each scheme on a model whose in_features its groups divide (the tiny Llama's down_proj
# has 688: not a multiple of 128).
SCHEMES = {
    "w4a16-group16-asym-llama": ("llama", dict(num_bits=4, strategy="group", group_size=16, symmetric=False)),
    "w8a16-channel-llama": ("llama", dict(num_bits=8, strategy="channel", symmetric=True)),
    "w4a16-group128-qwen2": ("qwen2", dict(num_bits=4, strategy="group", group_size=128, symmetric=True)),
    "w8a16-channel-asym-qwen2": ("qwen2", dict(num_bits=8, strategy="channel", symmetric=False)),
}
PACKED_LEAVES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


def _compress(src: Path, out: Path, weights: dict) -> None:
    """src's float model quantized and saved by compressed-tensors, as llm-compressor does."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    args = QuantizationArgs(type="int", **weights)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head"], quantization_status="frozen")
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            w = module.weight  # [N, K]
            w = w.unflatten(-1, (-1, args.group_size)) if args.strategy == "group" else w.unsqueeze(1)  # [N, G, -1]
            scale, zero_point = calculate_qparams(w.amin(-1), w.amax(-1), args)  # [N, G] each
            module.weight_scale.copy_(scale)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero_point)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for f in src.iterdir():  # the tokenizer
        if f.suffix != ".safetensors" and not (out / f.name).exists():
            shutil.copy(f, out / f.name)


def _modules(model_dir: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The checkpoint's quantized modules' tensors by leaf, and its other tensors."""
    packed, other = defaultdict(dict), {}
    for name, t in iter_safetensors(model_dir):
        module, _, leaf = name.rpartition(".")
        if leaf in PACKED_LEAVES:
            packed[module][leaf] = t
        else:
            other[name] = t
    return dict(packed), other


def _library_scheme(model_dir: Path):
    from compressed_tensors.quantization import QuantizationScheme

    raw = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    return QuantizationScheme(**raw["config_groups"]["group_0"])


def _decompressed_twin(ct_dir: Path, twin_dir: Path) -> None:
    """A float checkpoint holding the library's own decompression of ct_dir's weights."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor

    shutil.copytree(ct_dir, twin_dir)
    raw = json.loads((twin_dir / "config.json").read_text())
    del raw["quantization_config"]
    (twin_dir / "config.json").write_text(json.dumps(raw))
    packed, tensors = _modules(ct_dir)
    scheme = _library_scheme(ct_dir)
    for module, state in packed.items():
        tensors[f"{module}.weight"] = PackedQuantizationCompressor.decompress(state, scheme)["weight"].contiguous()
    (twin_dir / "model.safetensors").unlink()
    save_file(tensors, str(twin_dir / "model.safetensors"))


@pytest.fixture(scope="module", params=sorted(SCHEMES))
def checkpoint(request, tiny_model_dir, tiny_qwen2_dir, tmp_path_factory):
    """(scheme name, compressed-tensors checkpoint, its decompressed float twin)."""
    arch, weights = SCHEMES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    _compress(tiny_model_dir if arch == "llama" else tiny_qwen2_dir, folder / "ct", weights)
    _decompressed_twin(folder / "ct", folder / "twin")
    return request.param, folder / "ct", folder / "twin"


@pytest.fixture(scope="module")
def prompts():
    return shared_prefix_prompts()


def _generate(llm: LLM, prompts, logprobs=None):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=logprobs)
    # The shared prefix's second request runs after the first has cached its blocks.
    return llm.generate(prompts[:2], params, use_tqdm=False) + llm.generate(prompts[2:], params, use_tqdm=False)


def test_the_written_config_is_the_format_the_engine_reads(checkpoint):
    name, ct_dir, _ = checkpoint
    raw = json.loads((ct_dir / "config.json").read_text())["quantization_config"]
    assert (raw["quant_method"], raw["format"], raw["ignore"]) == ("compressed-tensors", "pack-quantized", ["lm_head"])
    assert raw["quantization_status"] == "compressed"
    (_, _, scheme), = parse(raw).groups
    assert (scheme.bits, scheme.group_size) == {
        "w4a16-group16-asym-llama": (4, 16), "w8a16-channel-llama": (8, None),
        "w4a16-group128-qwen2": (4, 128), "w8a16-channel-asym-qwen2": (8, None)}[name]


def test_unpacking_equals_the_librarys_bit_for_bit(checkpoint):
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor, unpack_from_int32

    _, ct_dir, _ = checkpoint
    qc = ModelConfig.from_dir(ct_dir).checkpoint_quantization
    (_, _, scheme), = qc.groups
    library_scheme = _library_scheme(ct_dir)
    packed, _ = _modules(ct_dir)
    assert len(packed) == 7 * ModelConfig.from_dir(ct_dir).num_hidden_layers
    offset = 1 << (scheme.bits - 1)
    for module, state in packed.items():
        ours = convert(qc, module, state, scheme, int(state["weight_shape"][1]), torch.float32)
        shape = torch.Size(state["weight_shape"].tolist())  # [N, K]
        q = unpack_from_int32(state["weight_packed"], scheme.bits, shape)  # [N, K] int8, signed
        assert torch.equal(unpack_along_k(ours.qweight, scheme.bits).t() - offset, q.to(torch.int32)), module
        if scheme.symmetric:
            assert "weight_zero_point" not in state
            assert torch.equal(ours.zeros, torch.full_like(ours.zeros, offset))
        else:
            zp = unpack_from_int32(state["weight_zero_point"], scheme.bits, state["weight_scale"].shape,
                                   packed_dim=0)  # [N, G] int8, signed
            assert torch.equal(ours.zeros.t() - offset, zp.float()), module
        assert torch.equal(ours.scales.t(), state["weight_scale"])
        expected = PackedQuantizationCompressor.decompress(state, library_scheme)["weight"]  # [N, K]
        assert torch.equal(dequantize(ours), expected), module


def test_the_engine_serves_the_decompressed_network(checkpoint, prompts):
    name, ct_dir, twin_dir = checkpoint
    # vLLM's flag value is accepted for such a checkpoint (and needed by none).
    flag = {"quantization": "compressed-tensors"} if name.startswith("w8a16-channel-llama") else {}
    quantized = LLM(model=str(ct_dir), **flag, **ENGINE_ARGS)
    twin = LLM(model=str(twin_dir), **ENGINE_ARGS)
    got = [o.outputs[0].token_ids for o in _generate(quantized, prompts)]
    assert got == [o.outputs[0].token_ids for o in _generate(twin, prompts)]
    assert quantized.engine.stats().prefix_cache_hits_total >= 32
    runner = quantized.engine.runner
    cfg = ModelConfig.from_dir(ct_dir)
    assert runner.quantization.layers == 4 * cfg.num_hidden_layers
    assert "compressed-tensors (W" in runner.describe()
    # The fused layers hold exactly the library's decompressed weights, and the float biases.
    reference = dict(iter_safetensors(twin_dir))
    for i, layer in enumerate(runner.model.model.layers):
        for path, parts in FUSED.items():
            module = layer.get_submodule(path)
            assert isinstance(module, QuantizedLinear)
            prefix = f"model.layers.{i}.{path.split('.')[0]}"
            weight = torch.cat([reference[f"{prefix}.{p}.weight"] for p in parts])  # [N, K]
            assert torch.equal(dequantize(module.quantized()), weight)
            biases = [reference.get(f"{prefix}.{p}.bias") for p in parts]
            assert (module.bias is None) == (biases[0] is None)
            if module.bias is not None:
                assert torch.equal(module.bias, torch.cat(biases))
    # (d) resident weights are the integers (plus float32 scales and zeros, and biases).
    expected = 0
    for layer in runner.model.model.layers:
        for path in FUSED:
            m = layer.get_submodule(path)
            n, k, groups = m.out_features, m.in_features, m.in_features // m.group_size
            expected += k * n * m.bits // 8 + 2 * groups * n * 4 + (n * 4 if m.bias is not None else 0)
    summary = runner.quantization
    assert summary.quantized_bytes == expected
    assert summary.quantized_bytes / summary.float_bytes < 0.3  # of float32
    assert quantized.engine.weight_bytes == twin.engine.weight_bytes - summary.float_bytes + expected


def test_the_triton_gemm_reads_the_converted_layout(checkpoint):
    """The CUDA path's integer GEMM (here in Triton's interpreter) on a converted layer."""
    pytest.importorskip("triton")
    _, ct_dir, _ = checkpoint
    qc = ModelConfig.from_dir(ct_dir).checkpoint_quantization
    (_, _, scheme), = qc.groups
    packed, _ = _modules(ct_dir)
    o_proj = packed["model.layers.0.self_attn.o_proj"]
    layer = QuantizedLinear(convert(qc, "model.layers.0.self_attn.o_proj", o_proj, scheme,
                                    int(o_proj["weight_shape"][1]), torch.float32))
    x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(layer.forward_gemm(x), layer(x), rtol=1e-4, atol=1e-4)


def test_logits_match_transformers_reading_the_same_checkpoint(checkpoint, prompts):
    """transformers decompresses the checkpoint with the library on load; the engine's
    greedy tokens and their log-probabilities agree with its forward pass."""
    from transformers import AutoModelForCausalLM

    name, ct_dir, _ = checkpoint
    if "asym" in name:
        # transformers 5.24 sizes asymmetric zero points unpacked ([N, G]) and refuses the
        # packed [N / per_word, G] compressed-tensors 0.20 writes: it cannot load these.
        pytest.skip("transformers cannot load asymmetric pack-quantized checkpoints")
    model = AutoModelForCausalLM.from_pretrained(ct_dir, dtype=torch.float32).eval()
    engine = _generate(LLM(model=str(ct_dir), **ENGINE_ARGS), prompts, logprobs=0)
    with torch.inference_mode():
        for prompt, out in zip(prompts, engine):
            tokens = out.outputs[0].token_ids
            ids = torch.tensor([prompt + tokens])
            logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt) - 1:-1]  # [MAX_NEW, V]
            assert logits.argmax(-1).tolist() == tokens
            reference = torch.log_softmax(logits.float(), -1)[torch.arange(len(tokens)), tokens]
            got = torch.tensor([lp.logprob for lp in out.outputs[0].logprobs])
            torch.testing.assert_close(got, reference, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def w4_dir(tiny_model_dir, tmp_path_factory):
    """One compressed-tensors checkpoint to break in different ways."""
    folder = tmp_path_factory.mktemp("w4-bad") / "ct"
    _compress(tiny_model_dir, folder, SCHEMES["w4a16-group16-asym-llama"][1])
    return folder


def _edited(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    edit(raw["quantization_config"])
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def _weights(q):
    return q["config_groups"]["group_0"]["weights"]


BAD_CONFIGS = {
    "method": (lambda q: q.update(quant_method="bitsandbytes"),
               r"config.json: quantization_config \(quant_method='bitsandbytes'\): this quantized format "
               r"is not read \(compressed-tensors .*, GPTQ .* and AWQ"),
    # Relabelled, the config is read as GPTQ's and refused at its first missing field.
    "gptq": (lambda q: q.update(quant_method="gptq"), r"quantization_config.bits=None: only 4 and 8-bit"),
    "bits": (lambda q: _weights(q).update(num_bits=3),
             r"quantization_config.config_groups.group_0.weights.num_bits=3: only 4 and 8-bit"),
    "group": (lambda q: _weights(q).update(group_size=48),
              r"quantization_config.config_groups.group_0.weights.group_size=48: does not divide "
              r"model.layers.0.self_attn.q_proj's in_features 256"),
    "activations": (lambda q: q["config_groups"]["group_0"].update(input_activations={
        "num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}),
        r"quantization_config.config_groups.group_0.input_activations: quantized activations are not"),
    "format": (lambda q: q.update(format="float-quantized"), r"quantization_config.format='float-quantized'"),
    "group-format": (lambda q: q["config_groups"]["group_0"].update(format="naive-quantized"),
                     r"quantization_config.config_groups.group_0.format='naive-quantized'"),
    "type": (lambda q: _weights(q).update(type="float"), r"group_0.weights.type='float'"),
    "strategy": (lambda q: _weights(q).update(strategy="tensor", group_size=None),
                 r"group_0.weights.strategy='tensor': only 'channel' and 'group'"),
    "dynamic": (lambda q: _weights(q).update(dynamic=True), r"group_0.weights.dynamic=True"),
    "kv-cache": (lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "float"}),
                 r"quantization_config.kv_cache_scheme: a quantized KV cache"),
    "lm-head": (lambda q: q.update(ignore=[]), r"group_0.weights quantizes lm_head, but only the decoder.*add it to quantization_config.ignore"),
    "fused-parts": (lambda q: q.update(ignore=["lm_head", "re:.*k_proj$"]),
                    r"model.layers.0.self_attn.\{q_proj,k_proj,v_proj\} are quantized differently"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_configs_are_refused_at_start_up_by_name(case, w4_dir, tmp_path):
    edit, message = BAD_CONFIGS[case]
    folder = _edited(w4_dir, tmp_path / case, edit)
    with pytest.raises(ValueError, match=message):
        LLM(model=str(folder), **ENGINE_ARGS)


def test_a_missing_tensor_is_refused_by_name(w4_dir, tmp_path):
    folder = tmp_path / "missing"
    shutil.copytree(w4_dir, folder)
    tensors = dict(iter_safetensors(w4_dir))
    del tensors["model.layers.2.mlp.up_proj.weight_scale"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"checkpoint is missing tensors: \['model.layers.2.mlp.up_proj.weight_scale'\]"):
        LLM(model=str(folder), **ENGINE_ARGS)


def test_the_quantization_flag_must_agree_with_the_checkpoint(w4_dir, tiny_model_dir):
    with pytest.raises(ValueError, match=r"quantization='int8' quantizes float weights at load, but config.json "
                                         r"has quantization_config \(quant_method='compressed-tensors'\)"):
        LLM(model=str(w4_dir), quantization="int8", **ENGINE_ARGS)
    with pytest.raises(ValueError, match=r"quantization='compressed-tensors' names the checkpoint's format, "
                                         r"but config.json has no quantization_config"):
        LLM(model=str(tiny_model_dir), quantization="compressed-tensors", **ENGINE_ARGS)


def test_a_preset_group_and_a_channel_group_size_of_minus_one_are_read():
    preset = parse({"quant_method": "compressed-tensors", "format": "pack-quantized",
                    "config_groups": {"W4A16": ["Linear"]}, "ignore": ["lm_head"]})
    (_, targets, scheme), = preset.groups
    assert (targets, scheme.bits, scheme.group_size, scheme.symmetric) == (("Linear",), 4, 128, True)
    channel = parse({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "g": {"targets": ["re:.*proj$"], "weights": {"num_bits": 8, "group_size": -1}}}})
    assert channel.groups[0][2].group_size is None
    assert channel.scheme_for("model.layers.0.mlp.up_proj", "Linear") is channel.groups[0][2]
    assert channel.scheme_for("lm_head", "Linear") is None
