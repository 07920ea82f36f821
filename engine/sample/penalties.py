"""Presence, frequency and repetition penalties, with each request's token counts kept
on its device and grown by its new tokens only (O(new tokens) per step, not O(length))."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PenaltyCounts:
    """One request's counts of generated tokens and mask of prompt tokens."""

    output_counts: torch.Tensor  # [vocab] float32
    prompt_mask: torch.Tensor  # [vocab] bool
    num_counted: int = 0  # output tokens already in output_counts

    @classmethod
    def of_prompt(cls, prompt_ids: list[int], vocab_size: int, device: torch.device) -> PenaltyCounts:
        mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        mask[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
        return cls(torch.zeros(vocab_size, dtype=torch.float32, device=device), mask)

    def update(self, output_ids: list[int]) -> None:
        """Count the output tokens appended since the last update."""
        new = output_ids[self.num_counted:]
        if new:
            ids = torch.tensor(new, dtype=torch.long, device=self.output_counts.device)
            self.output_counts.index_add_(0, ids, torch.ones(len(new), device=ids.device))
            self.num_counted = len(output_ids)


def apply_penalties(
    logits: torch.Tensor,  # [B, vocab] float32
    counts: torch.Tensor,  # [B, vocab] float32, generated tokens
    prompt_mask: torch.Tensor,  # [B, vocab] bool
    presence: torch.Tensor,  # [B]
    frequency: torch.Tensor,  # [B]
    repetition: torch.Tensor,  # [B]
) -> torch.Tensor:  # [B, vocab]
    seen = prompt_mask | (counts > 0)
    rep = repetition[:, None].expand_as(logits)
    # Repetition penalty (prompt and output): shrink positive logits, grow negative ones.
    logits = torch.where(seen & (logits > 0), logits / rep, logits)
    logits = torch.where(seen & (logits <= 0), logits * rep, logits)
    # Presence and frequency penalties (output only), as OpenAI defines them.
    logits = logits - frequency[:, None] * counts
    return logits - presence[:, None] * (counts > 0).float()
