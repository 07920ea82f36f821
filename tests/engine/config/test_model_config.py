"""config.json fields the engine does not implement are refused with the field's name,
never served as a different network (the real engine and the simulator alike)."""

from __future__ import annotations

import pytest

from kvpilot.engine.config.model import ModelConfig
from kvpilot.engine.sim.shapes import ModelShape

LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 512,
         "intermediate_size": 1376, "num_hidden_layers": 2, "num_attention_heads": 8,
         "num_key_value_heads": 2, "max_position_embeddings": 32768, "hidden_act": "silu"}


@pytest.mark.parametrize("extra,message", [
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, r"sliding_window=4096 \(attention limited"),
    ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096, "use_sliding_window": True},
     "sliding_window=4096"),
    ({"num_local_experts": 8}, "num_local_experts=8 \\(a mixture of experts\\)"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not implemented"),
    ({"mlp_bias": True}, "mlp_bias=true is not implemented"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn' is not implemented"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic'"),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
     r"quantization_config \(quant_method='bitsandbytes'\): this quantized format is not read"),
])
def test_unimplemented_fields_are_refused_by_name(extra, message):
    raw = {**LLAMA, **extra}
    with pytest.raises(ValueError, match="config.json: " + message):
        ModelConfig.from_dict(raw)
    with pytest.raises(ValueError, match="simulate_model: m: config.json: " + message):
        ModelShape.from_config(raw, "m")


def test_quantized_checkpoints_the_engine_reads_the_simulator_refuses():
    raw = {**LLAMA, "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}
    assert ModelConfig.from_dict(raw).checkpoint_quantization.method == "gptq"
    with pytest.raises(ValueError, match=r"simulate_model: m: config.json: quantization_config "
                                         r"\(quant_method='gptq'\): .*only float32, bfloat16 and float16"):
        ModelShape.from_config(raw, "m")


@pytest.mark.parametrize("extra", [
    {},
    {"architectures": ["MistralForCausalLM"], "sliding_window": None},  # Mistral v0.2+: no window
    {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096, "use_sliding_window": False},
    {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096},  # Qwen2Config's default: off
    {"architectures": ["MistralForCausalLM"], "sliding_window": 32768},  # as long as the context
    {"mlp_bias": False},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
])
def test_windows_that_never_apply_are_served(extra):
    assert ModelConfig.from_dict({**LLAMA, **extra}).max_position_embeddings == 32768
