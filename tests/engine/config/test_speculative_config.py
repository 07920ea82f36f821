"""SpeculativeConfig: vLLM's --speculative-config shapes parse; each bad input is a
ValueError naming its field as speculative_config.<field>."""

import json

import pytest

from kvpilot.engine.config.speculative import MAX_SPECULATIVE_TOKENS, SpeculativeConfig


def test_vllm_ngram_shape():
    config = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}')
    assert config == SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=4,
                                       prompt_lookup_min=1, model=None)
    config = SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 5)


def test_vllm_draft_model_shape():
    config = SpeculativeConfig.parse('{"model": "/models/draft", "num_speculative_tokens": 3}')
    assert config == SpeculativeConfig(method="draft_model", num_speculative_tokens=3,
                                       model="/models/draft")
    explicit = SpeculativeConfig.parse(
        {"method": "draft_model", "model": "builtin:tiny", "num_speculative_tokens": 1})
    assert explicit.method == "draft_model" and explicit.model == "builtin:tiny"


def test_none_empty_and_instances_pass_through():
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse("") is None
    assert SpeculativeConfig.parse("   ") is None
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=MAX_SPECULATIVE_TOKENS)
    assert SpeculativeConfig.parse(config) is config


def _ngram(**extra):
    return {"method": "ngram", "num_speculative_tokens": 4, **extra}


@pytest.mark.parametrize("value, field", [
    ("{not json", "speculative_config must be a JSON object"),
    ("[1, 2]", "speculative_config must be a JSON object"),
    ("4", "speculative_config must be a JSON object"),
    (42, "speculative_config must be a JSON object"),
    (_ngram(draft_tensor_parallel_size=1), "speculative_config.draft_tensor_parallel_size"),
    ({"method": "eagle", "num_speculative_tokens": 4}, "speculative_config.method"),
    ({"num_speculative_tokens": 4}, "speculative_config.method"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    (_ngram(num_speculative_tokens=0), "speculative_config.num_speculative_tokens"),
    (_ngram(num_speculative_tokens=MAX_SPECULATIVE_TOKENS + 1), "speculative_config.num_speculative_tokens"),
    (_ngram(num_speculative_tokens=True), "speculative_config.num_speculative_tokens"),
    (_ngram(num_speculative_tokens=2.0), "speculative_config.num_speculative_tokens"),
    (_ngram(num_speculative_tokens="4"), "speculative_config.num_speculative_tokens"),
    (_ngram(prompt_lookup_min=0), "speculative_config.prompt_lookup_min"),
    (_ngram(prompt_lookup_max=True), "speculative_config.prompt_lookup_max"),
    (_ngram(prompt_lookup_min=5, prompt_lookup_max=3), "speculative_config.prompt_lookup_min"),
    (_ngram(prompt_lookup_min=5), "speculative_config.prompt_lookup_min"),  # above the default max 4
    (_ngram(model="/models/draft"), "speculative_config.model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "draft_model", "model": "", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"model": "d", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "speculative_config.prompt_lookup_max"),
])
def test_bad_input_names_the_field(value, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        SpeculativeConfig.parse(json.dumps(value) if isinstance(value, dict) else value)


def test_unknown_fields_are_all_named():
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.parse(_ngram(foo=1, bar=2))
    assert "bar" in str(e.value) and "foo" in str(e.value)


def test_unknown_method_lists_the_known_ones():
    with pytest.raises(ValueError, match="ngram, draft_model"):
        SpeculativeConfig.parse({"method": "medusa", "num_speculative_tokens": 2})


def test_direct_construction_is_checked():
    with pytest.raises(ValueError, match=r"speculative_config\.num_speculative_tokens"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=17)
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        SpeculativeConfig(method="draft_model", num_speculative_tokens=2)
    with pytest.raises(ValueError, match=r"speculative_config\.method"):
        SpeculativeConfig(method="NGRAM", num_speculative_tokens=2)
