"""Tokenizer and incremental detokenizer: equal to transformers, whole characters only."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.engine.core.detokenizer import IncrementalDetokenizer
from kvpilot.engine.core.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "The capital of France is",
    "",
    " ",
    "  leading and   multiple   spaces\t\ttabs\n\n\nnewlines  ",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "emoji 🤗🚀 family 👨‍👩‍👧 flag 🇫🇷 done",
    "中文字符和日本語のテキスト、한국어",
    "Ünïcödé café naïve, e\u0301 combining vs é",
    "ﬁ ligature ＡＢＣ fullwidth",
    "<|im_start|>user\nhi<|im_end|> and <|begin_of_text|> inside",
    "123456789 3.14159 1e-10 0x1F",
    "don't can't I'm we'll THEY'RE",
    "x" * 300,
    "\u200b zero width \ufeff bom \ufffd replacement",
]

CHATS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "emoji 🤗 and 中文"},
    ],
    [{"role": "user", "content": [{"type": "text", "text": "part one "}, {"type": "text", "text": "two"}]}],
    [{"role": "user", "content": "  spaces  \n\n", "name": None}],
]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tiny_model_dir, tiny_qwen2_dir):
    return tiny_model_dir if request.param == "llama" else tiny_qwen2_dir


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf_tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_encode_equals_transformers(tok, hf_tok):
    for text in TEXTS:
        assert tok.encode(text) == hf_tok(text).input_ids, text
        assert tok.encode(text, add_special_tokens=False) == hf_tok(text, add_special_tokens=False).input_ids
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]


def test_encode_starts_with_bos(tok):
    assert tok.encode("Hello")[0] == tok.bos_token_id == 0
    assert tok.encode("Hello", add_special_tokens=False)[0] != tok.bos_token_id


def test_decode_equals_transformers(tok, hf_tok):
    for text in TEXTS:
        ids = tok.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)
    # Byte-level BPE round-trips text exactly (NFC-normal text, for Qwen2's normaliser).
    assert tok.decode(tok.encode(TEXTS[6])) == TEXTS[6]
    assert tok.decode(tok.encode(TEXTS[5])) == TEXTS[5]


def test_special_tokens_and_sizes(tok, hf_tok, model_dir):
    assert tok.bos_token == "<|begin_of_text|>" and tok.eos_token == "<|end_of_text|>"
    assert (tok.bos_token_id, tok.token_to_id("<|end_of_text|>")) == (0, 1)
    assert tok.token_to_id("<|im_start|>") == 2
    assert tok.eos_token_ids == frozenset({1, 3})  # <|end_of_text|>, <|im_end|>
    assert tok.all_special_ids == [0, 1, 2, 3]
    assert tok.vocab_size == len(tok) == len(hf_tok)
    config = json.loads((model_dir / "config.json").read_text())
    assert tok.vocab_size == config["vocab_size"]


def test_tokens_and_token_text(tok, hf_tok):
    ids = tok.encode("Hello world 🤗 中<|im_end|>", add_special_tokens=True)
    assert tok.convert_ids_to_tokens(ids) == hf_tok.convert_ids_to_tokens(ids)
    assert [tok.token_to_text(i) for i in ids] == [hf_tok.decode([i]) for i in ids]
    assert tok.token_to_text(3) == "<|im_end|>"
    # The emoji's 4 bytes span several tokens; a part alone shows as U+FFFD.
    emoji_ids = tok.encode("🤗", add_special_tokens=False)
    assert len(emoji_ids) > 1 and "\ufffd" in tok.token_to_text(emoji_ids[0])
    # Single-byte tokens sit right after the special tokens (the hypothesis test uses them).
    assert all(len(tok.convert_ids_to_tokens([i])[0]) == 1 for i in range(4, 260))


def test_chat_template_equals_transformers(tok, hf_tok):
    for chat in CHATS:
        for gen in (True, False):
            ours = tok.apply_chat_template(chat, add_generation_prompt=gen)
            theirs = hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert ours == theirs
    assert tok.apply_chat_template(CHATS[0]) == (
        "<|begin_of_text|><|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n"
    )
    rendered = tok.apply_chat_template(CHATS[1])
    assert tok.encode(rendered, add_special_tokens=False) == hf_tok.apply_chat_template(
        CHATS[1], tokenize=True, add_generation_prompt=True, return_dict=False
    )


def _copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    path = dst / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return dst


def test_no_chat_template_raises(tiny_model_dir, tmp_path):
    folder = _copy_with_config(tiny_model_dir, tmp_path / "m", chat_template=None)
    tok = Tokenizer.from_dir(folder)
    with pytest.raises(ValueError, match="has no chat template"):
        tok.apply_chat_template(CHATS[0])
    assert tok.encode("hi") == Tokenizer.from_dir(tiny_model_dir).encode("hi")


def test_template_helpers_match_transformers(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    template = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}\n"
        "  {% if loop.last %}{% break %}{% endif %}{% endfor %}"
        "{{ eos_token }}{{ tools is none }}"
    )
    folder = _copy_with_config(tiny_model_dir, tmp_path / "m", chat_template=template)
    tok, hf = Tokenizer.from_dir(folder), AutoTokenizer.from_pretrained(folder)
    chat = [{"role": "user", "content": "<b>&\"é\""}, {"role": "assistant", "content": "ok"}]
    assert tok.apply_chat_template(chat) == hf.apply_chat_template(chat, tokenize=False,
                                                                    add_generation_prompt=True)
    with pytest.raises(ValueError, match="bad role system"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_template_from_jinja_file(tiny_model_dir, tmp_path):
    folder = _copy_with_config(tiny_model_dir, tmp_path / "m", chat_template=None)
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer.from_dir(folder).apply_chat_template(CHATS[0]) == "Hi there!!"


def test_template_cannot_escape_sandbox(tiny_model_dir, tmp_path):
    folder = _copy_with_config(
        tiny_model_dir, tmp_path / "m", chat_template="{{ messages.__class__.__mro__ }}"
    )
    with pytest.raises(ValueError):
        Tokenizer.from_dir(folder).apply_chat_template(CHATS[0])


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


# -- incremental detokenization -----------------------------------------------------------


def _stream(tok, prompt_ids, output_ids, chunks=None, skip=True):
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    deltas = []
    sizes = chunks or [1] * len(output_ids)
    i = 0
    for size in sizes:
        deltas.append(detok.add(output_ids[i:i + size]))
        i += size
    deltas.append(detok.add(output_ids[i:]))
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return deltas, detok


@pytest.mark.parametrize("text", [t for t in TEXTS if t])
def test_streaming_equals_decode(tok, text):
    prompt = tok.encode("Prompt: ")
    out = tok.encode(text, add_special_tokens=False)
    deltas, detok = _stream(tok, prompt, out)
    assert detok.text == tok.decode(out)
    # No delta ever shows half a character.
    assert not any("\ufffd" in d for d in deltas) or "\ufffd" in text


def test_partial_character_is_held_back(tok):
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    pieces = tok.encode("a🤗b", add_special_tokens=False)
    assert len(pieces) > 3  # the emoji is split across byte tokens
    emitted = [detok.add([i]) for i in pieces]
    assert emitted[0] == "a"
    assert "".join(emitted) == "a🤗b"
    assert all(e in ("", "a", "🤗", "b", "🤗b") for e in emitted)


def test_invalid_tail_flushes_as_replacement(tok):
    emoji = tok.encode("🤗", add_special_tokens=False)
    ok = tok.encode("ok", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(ok) == "ok"
    assert detok.add(emoji[:1]) == ""  # incomplete: held back, no U+FFFD
    assert detok.text == "ok"
    assert detok.flush() == "\ufffd"
    assert detok.text == tok.decode(ok + emoji[:1]) == "ok\ufffd"


def test_special_tokens_skipped_or_kept(tok):
    out = tok.encode("hi", add_special_tokens=False) + [3] + tok.encode(" there", add_special_tokens=False)
    assert _stream(tok, [], out)[1].text == "hi there"
    assert _stream(tok, [], out, skip=False)[1].text == "hi<|im_end|> there"


def test_window_stays_small(tok):
    out = tok.encode("The quick brown fox jumps over the lazy dog. " * 40, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Say:"))
    for i in out:
        detok.add([i])
        assert len(detok._window) <= 8
    assert detok.text == tok.decode(out)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_token_streams(tok, data):
    """Property: concatenated deltas + flush == decode(all output ids)."""
    ids = st.integers(min_value=0, max_value=tok.vocab_size - 1)
    # Bias toward byte tokens (ids 4..259 hold single bytes) so characters get split.
    byte_ids = st.integers(min_value=4, max_value=259)
    out = data.draw(st.lists(st.one_of(ids, byte_ids), max_size=40), label="out")
    prompt_text = data.draw(st.text(max_size=12), label="prompt")
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=20), label="chunks")
    skip = data.draw(st.booleans(), label="skip")
    _, detok = _stream(tok, tok.encode(prompt_text), out, chunks, skip)
    assert detok.text == tok.decode(out, skip_special_tokens=skip)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.characters(codec="utf-8"), max_size=30))
def test_random_text_streams_without_replacement(tok, text):
    out = tok.encode(text, add_special_tokens=False)
    deltas, detok = _stream(tok, tok.encode("> "), out)
    assert detok.text == tok.decode(out)
    if "\ufffd" not in text:
        assert not any("\ufffd" in d for d in deltas)
