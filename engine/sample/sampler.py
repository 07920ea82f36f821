"""Turns the last-position logits of a step into tokens, with no host/device sync.

Sampling uses the exponential race (argmax of p / q with q ~ Exp(1)), which draws
from p exactly and lets each seeded request draw its noise from its own generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .argmax_rows import argmax_rows
from .penalties import PenaltyCounts, apply_penalties
from ..core.request import Request


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step, as device tensors."""

    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_k: torch.Tensor | None  # [B] int64, vocab size where disabled
    top_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    generators: list[torch.Generator | None]
    all_greedy: bool
    max_logprobs: int | None  # None: none requested; 0: only the sampled token's
    # Penalties, built only when a row has one.
    presence: torch.Tensor | None = None  # [B]
    frequency: torch.Tensor | None = None  # [B]
    repetition: torch.Tensor | None = None  # [B]
    output_counts: torch.Tensor | None = None  # [B, vocab] counts of generated tokens
    prompt_mask: torch.Tensor | None = None  # [B, vocab] token appears in the prompt
    # Stop tokens masked while a row is below its min_tokens.
    min_tokens_mask: torch.Tensor | None = None  # [B, vocab] bool

    @classmethod
    def build(cls, requests: list[Request], vocab_size: int, device: torch.device) -> SamplingBatch:
        params = [r.sampling_params for r in requests]
        b = len(requests)

        def col(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=device)

        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        batch = cls(
            temperature=col([p.temperature if not p.greedy else 0.0 for p in params]),
            top_k=col(top_k, torch.int64) if any(k < vocab_size for k in top_k) else None,
            top_p=col([p.top_p for p in params]) if any(p.top_p < 1.0 for p in params) else None,
            min_p=col([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None,
            generators=[r.sample.generator for r in requests],
            all_greedy=all(p.greedy for p in params),
            max_logprobs=max((p.logprobs or 0) for p in params) if any(
                p.logprobs is not None for p in params) else None,
        )
        if any(p.has_penalties for p in params):
            batch.presence = col([p.presence_penalty for p in params])
            batch.frequency = col([p.frequency_penalty for p in params])
            batch.repetition = col([p.repetition_penalty for p in params])
            none = None  # rows without penalties: no counts, no prompt tokens
            rows = []
            for r in requests:
                if r.sampling_params.has_penalties:
                    if r.sample.penalty_counts is None:
                        r.sample.penalty_counts = PenaltyCounts.of_prompt(r.prompt_token_ids, vocab_size, device)
                    r.sample.penalty_counts.update(r.output_token_ids)
                    rows.append(r.sample.penalty_counts)
                else:
                    if none is None:
                        none = PenaltyCounts.of_prompt([], vocab_size, device)
                    rows.append(none)
            batch.output_counts = torch.stack([c.output_counts for c in rows])  # [B, vocab]
            batch.prompt_mask = torch.stack([c.prompt_mask for c in rows])  # [B, vocab]
        below_min = [
            i for i, r in enumerate(requests)
            if len(r.output_token_ids) < r.sampling_params.min_tokens and r.stop_token_ids
        ]
        if below_min:
            mask = torch.zeros(b, vocab_size, dtype=torch.bool)
            for i in below_min:
                mask[i, [t for t in requests[i].stop_token_ids if t < vocab_size]] = True
            batch.min_tokens_mask = mask.to(device)
        return batch


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprob: torch.Tensor | None = None  # [B] logprob of the sampled token
    top_ids: torch.Tensor | None = None  # [B, K]
    top_logprobs: torch.Tensor | None = None  # [B, K]


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        # logits [B, vocab] float32
        raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.max_logprobs is not None else None
        if batch.output_counts is not None:
            logits = apply_penalties(logits, batch.output_counts, batch.prompt_mask, batch.presence,
                                     batch.frequency, batch.repetition)
        if batch.min_tokens_mask is not None:
            logits = logits.masked_fill(batch.min_tokens_mask, float("-inf"))
        greedy_ids = argmax_rows(logits)
        if batch.all_greedy:
            token_ids = greedy_ids
        else:
            token_ids = torch.where(batch.temperature == 0, greedy_ids, self._random(logits, batch))
        out = SamplerOutput(token_ids=token_ids)
        if raw_logprobs is not None:
            out.logprob = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)
            out.top_logprobs, out.top_ids = raw_logprobs.topk(batch.max_logprobs, dim=-1)
        return out

    def _random(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        probs = processed_probs(logits, batch)  # [B, vocab]
        noise = torch.empty_like(probs)
        noise.exponential_()
        for i, gen in enumerate(batch.generators):
            if gen is not None:
                noise[i].exponential_(generator=gen)
        return argmax_rows(probs / noise)


def processed_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution a random row samples from: temperature, top-k/top-p, then min-p
    (unnormalised after min-p; sampling and speculation's verification both allow that).
    Greedy rows get temperature 1 here; their callers take the argmax instead."""
    temp = torch.where(batch.temperature == 0, 1.0, batch.temperature)
    logits = logits / temp[:, None]  # [B, vocab]
    if batch.top_k is not None or batch.top_p is not None:
        logits = _top_k_top_p(logits, batch.top_k, batch.top_p)
    probs = torch.softmax(logits, dim=-1)  # [B, vocab]
    if batch.min_p is not None:
        floor = batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def _top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, vocab]
    vocab = logits.shape[-1]
    if top_k is not None:
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
