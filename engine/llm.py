"""Offline batch inference, shaped like vLLM's `LLM`."""

from __future__ import annotations

import itertools
from typing import Sequence

from tqdm.auto import tqdm

from .config.engine import EngineConfig
from .llm_engine import LLMEngine
from .core.outputs import RequestOutput
from .core.sampling_params import SamplingParams

Prompt = str | list[int] | dict


class LLM:
    """`LLM(model=DIR, **engine_args).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str, **engine_args) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in order.
        A prompt is text, a list of token ids, or {"prompt_token_ids": [...]}."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"sampling_params has {len(params)} entries but there are {len(prompts)} prompts"
            )
        order = []
        for prompt, p in zip(prompts, params):
            if isinstance(prompt, dict):
                prompt = prompt.get("prompt_token_ids") or prompt.get("prompt")
            request_id = str(next(self._ids))
            self.engine.add_request(request_id, prompt, p)
            order.append(request_id)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(order), desc="Generating", disable=not use_tqdm, unit="req") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[r] for r in order]

    def chat(
        self, messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [tok.encode(tok.apply_chat_template(c), add_special_tokens=False) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)
