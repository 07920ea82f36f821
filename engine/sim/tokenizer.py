"""The simulated model's tokenizer: the model directory's own tokenizer.json when the
simulated model came from one, else the tiny models' byte-level BPE (trained in
process, without torch), so text prompts, chat templates and streamed text all work."""

from __future__ import annotations

from ..tiny.tokenizer import BOS_TOKEN, EOS_TOKEN, IM_END, tokenizer_config, train_tokenizer
from ..core.tokenizer import Tokenizer

SIM_VOCAB = 4096  # the tiny models' tokenizer size


def simulated_tokenizer(tokenizer_dir: str | None, max_position_embeddings: int) -> Tokenizer:
    if tokenizer_dir is not None:
        return Tokenizer.from_dir(tokenizer_dir)
    tok = train_tokenizer(SIM_VOCAB, "llama")
    ids = {t: tok.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, IM_END)}
    return Tokenizer(tok, tokenizer_config(max_position_embeddings, "llama"),
                     {"bos_token_id": ids[BOS_TOKEN], "eos_token_id": [ids[EOS_TOKEN], ids[IM_END]]})
