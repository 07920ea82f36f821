"""The tokenizer side of a tiny model: a byte-level BPE trained at creation time on
source files of Python's own standard library, its special tokens and chat template."""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path
from typing import Any

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, IM_START, IM_END]  # ids 0..3, in this order
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # every byte plus the special tokens
CORPUS_BYTES = 1_000_000  # ~0.4 s of BPE training on one core

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Pre-tokenizer split rules of the families (Llama 3 groups up to 3 digits, Qwen2 splits each).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_REGEX = {"llama": _LLAMA3_SPLIT, "mistral": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}


def train_tokenizer(vocab: int, arch: str = "llama"):
    """A fresh `tokenizers.Tokenizer`; see `_train_tokenizer_json` (cached per process)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_train_tokenizer_json(vocab, arch))


@functools.lru_cache(maxsize=8)
def _train_tokenizer_json(vocab: int, arch: str) -> str:
    """Byte-level BPE trained on stdlib sources; adds BOS on encode, as Llama 3 does.

    The pre-tokenizer is the family's own (Llama 3's split regex; Qwen2's regex plus
    NFC normalisation), so transformers' per-family tokenizer classes, which rebuild
    the pipeline from those rules, tokenize exactly as tokenizer.json does.
    """
    from tokenizers import (Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                            processors, trainers)

    tok = Tokenizer(models.BPE())
    if arch == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_REGEX[arch]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok.to_str()


def _corpus(cap: int = CORPUS_BYTES) -> list[str]:
    """A fixed, sorted list of standard-library sources, capped in bytes."""
    texts: list[str] = []
    size = 0
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        texts.append(text)
        size += len(text.encode("utf-8"))
        if size >= cap:
            return texts
    # A Python installed without sources: fall back to the docstrings it still carries.
    import builtins

    for name in sorted(dir(builtins)):
        doc = getattr(getattr(builtins, name), "__doc__", None)
        if isinstance(doc, str):
            texts.append(doc)
    return texts


def tokenizer_config(model_max_length: int, arch: str) -> dict[str, Any]:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,  # for batched transformers.generate; the engine pads nothing
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "model_input_names": ["input_ids", "attention_mask"],
        "chat_template": CHAT_TEMPLATE,
    }
    if arch == "qwen2":
        # transformers always loads Qwen2 with its own class, whose defaults would add
        # an unknown "<|endoftext|>" token as unk; say there is none.
        config.update(unk_token=None)
    return config
