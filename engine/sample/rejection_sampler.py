"""Verification of draft tokens: speculative sampling's accept/resample step, batched.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding",
Algorithm 1) and Chen et al. 2023: per row, drafts x_1..x_K' from a draft distribution
q, the target's distributions p_1..p_K'+1 at those positions. For i = 1..K', x_i is
accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection a token is
drawn from the residual norm(max(0, p_i - q_i)) and the row stops; with all K' accepted
a bonus token is drawn from p_K'+1. Every emitted token is then distributed exactly as
the target alone would have sampled it, and one target pass yields 1..K'+1 tokens.

An n-gram proposer is deterministic: q_i is a point mass at x_i, so x_i is accepted with
probability p_i(x_i) and the residual is p_i with x_i zeroed.

Greedy rows (temperature 0) have a one-hot target at argmax_rows of the logits; the rule
then reads "accept while the draft equals the target's argmax, then emit the argmax",
which is done as such, with no randomness, so a greedy row emits the very tokens (ties
included) the non-speculative sampler would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .argmax_rows import argmax_rows


@dataclass
class VerifyOutput:
    token_ids: list[list[int]]  # per row: the accepted drafts then one more token; num_accepted + 1
    num_accepted: list[int]  # per row


def rejection_sample(
    target_probs: torch.Tensor,  # [B, K+1, V] float32
    target_argmax: torch.Tensor,  # [B, K+1] int64
    draft_token_ids: torch.Tensor,  # [B, K] int64 (padding: any id)
    num_draft_tokens: list[int],  # [B] K'_b <= K
    draft_probs: torch.Tensor | None,  # [B, K, V] float32; None: point masses (n-gram)
    greedy: torch.Tensor,  # [B] bool
    generators: list[torch.Generator | None],  # per row; None: the global RNG
) -> VerifyOutput:
    """The tokens each row emits in this step: its accepted drafts, then one token drawn
    from the residual at the first rejection, or the bonus token after the last draft.

    target_probs holds the rows' processed target distributions (after temperature,
    top-k, top-p, min-p) at each draft position and the one after the last; rows need not
    sum to 1 (min-p masking leaves them short): both p and q are divided by their sums
    here, since the acceptance ratio and the residual are only right for normalised ones.
    target_argmax is argmax_rows of the processed logits, used by greedy rows (whose
    target_probs do not matter: anything there, even NaN, is computed on and discarded). A row with K'_b == 0 samples from p_1: a normal step.

    Randomness: a seeded row draws exactly K'_b uniforms and then V exponentials from its
    generator, whatever the batch's padded K, so a seeded request is reproducible
    whatever shares its batch. Draft ids are assumed in [0, V) where K'_b covers them
    (checking would cost a host sync). The only host sync is the final `.tolist()`.
    """
    b, k, vocab = _check(target_probs, target_argmax, draft_token_ids, num_draft_tokens,
                         draft_probs, greedy, generators)
    device = target_probs.device
    n = torch.tensor(num_draft_tokens, dtype=torch.int64, device=device)  # [B]
    rows = torch.arange(b, device=device)  # [B]
    valid = torch.arange(k, device=device)[None, :] < n[:, None]  # [B, K]
    drafts = torch.where(valid, draft_token_ids, 0)  # [B, K] padding -> a safe index
    p_sum = target_probs.sum(dim=-1)  # [B, K+1]
    p_x = target_probs[:, :k].gather(2, drafts[:, :, None]).squeeze(2) / p_sum[:, :k]  # [B, K]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)  # [B, K] a point mass at the draft
    else:
        q_sum = draft_probs.sum(dim=-1)  # [B, K]
        q_x = draft_probs.gather(2, drafts[:, :, None]).squeeze(2) / q_sum  # [B, K]

    uniform = torch.rand(b, k, device=device)  # [B, K] in [0, 1)
    noise = torch.empty(b, vocab, device=device).exponential_()  # [B, V]
    for i, gen in enumerate(generators):
        if gen is not None:
            uniform[i, :num_draft_tokens[i]].uniform_(generator=gen)
            noise[i].exponential_(generator=gen)

    # u < p/q with probability min(1, p/q); written as u * q < p so that q(x) == 0 (a
    # draft the draft model could not have drawn) accepts where p(x) > 0, as the ratio's
    # min(1, inf) does, and rejects where p(x) == 0.
    accept_random = uniform * q_x < p_x  # [B, K]
    accept_greedy = drafts == target_argmax[:, :k]  # [B, K]
    accept = torch.where(greedy[:, None], accept_greedy, accept_random) & valid  # [B, K]
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B] drafts before the first rejection

    # The one more token, from position num_accepted: the residual there when a draft was
    # rejected, p there when all were accepted (the bonus position, num_accepted == K'_b).
    # The exponential race below draws index j with probability dist_j / sum(dist), so
    # dist may be unnormalised: that race is the residual's normalisation.
    p_here_sum = p_sum[rows, num_accepted]  # [B]
    dist = target_probs[rows, num_accepted]  # [B, V] a copy of p there, unnormalised
    if k:
        at = num_accepted.clamp(max=k - 1)  # [B] the rejected draft's position where one was
        rejected = num_accepted < n  # [B]
        # The residual's mass is sum(max(0, p - q)) = sum(max(0, q - p)) >= q(x) - p(x) > 0
        # whenever x can be rejected (a rejection needs p(x) < q(x)), so it is never empty
        # in exact arithmetic. In floats it can be (p == q up to rounding); then p itself
        # is drawn, which is within rounding of the residual and never emits a token p
        # gives no mass to.
        if draft_probs is None:
            # The point mass's residual: p with x zeroed. Its mass p_sum - p(x) is exactly 0
            # only when every other entry is 0 (adding zeros to p(x) is exact), so the
            # check needs no pass over V.
            x = drafts[rows, at]  # [B]
            p_of_x = dist.gather(1, x[:, None]).squeeze(1)  # [B]
            zero_x = rejected & (p_here_sum - p_of_x > 0)  # [B]
            dist.scatter_(1, x[:, None], torch.where(zero_x, 0.0, p_of_x)[:, None])
        else:
            p = dist / p_here_sum[:, None]  # [B, V]
            q = draft_probs[rows, at] / q_sum[rows, at][:, None]  # [B, V]
            residual = (p - q).clamp_(min=0.0)  # [B, V] max(0, p - q), not max(0, q - p)
            use = rejected & (residual.sum(dim=-1) > 0)  # [B]
            dist = torch.where(use[:, None], residual, p)  # [B, V]
    sampled = argmax_rows(dist.div_(noise))  # [B]
    emitted = torch.where(greedy, target_argmax[rows, num_accepted], sampled)  # [B]

    out = torch.cat([drafts, emitted[:, None]], dim=1)  # [B, K+1]
    out.scatter_(1, num_accepted[:, None], emitted[:, None])
    table = torch.cat([out, num_accepted[:, None]], dim=1).tolist()  # one transfer
    accepted = [row[-1] for row in table]
    return VerifyOutput(token_ids=[row[:a + 1] for row, a in zip(table, accepted)],
                        num_accepted=accepted)


def _check(target_probs, target_argmax, draft_token_ids, num_draft_tokens, draft_probs, greedy,
           generators) -> tuple[int, int, int]:
    """(B, K, V) from the shapes; ValueError naming the argument otherwise."""
    if draft_token_ids.dim() != 2:
        raise ValueError(f"draft_token_ids must be [B, K], got shape {tuple(draft_token_ids.shape)}")
    b, k = draft_token_ids.shape
    if target_probs.dim() != 3 or tuple(target_probs.shape[:2]) != (b, k + 1):
        raise ValueError(f"target_probs must be [B, K+1, V] = [{b}, {k + 1}, V], got shape "
                         f"{tuple(target_probs.shape)}")
    vocab = target_probs.shape[2]
    if tuple(target_argmax.shape) != (b, k + 1):
        raise ValueError(f"target_argmax must be [B, K+1] = [{b}, {k + 1}], got shape "
                         f"{tuple(target_argmax.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (b, k, vocab):
        raise ValueError(f"draft_probs must be [B, K, V] = [{b}, {k}, {vocab}], got shape "
                         f"{tuple(draft_probs.shape)}")
    if tuple(greedy.shape) != (b,) or greedy.dtype != torch.bool:
        raise ValueError(f"greedy must be a [B] = [{b}] bool tensor, got {greedy.dtype} "
                         f"{tuple(greedy.shape)}")
    if len(num_draft_tokens) != b or any(
            isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= k for c in num_draft_tokens):
        raise ValueError(f"num_draft_tokens must be {b} integers in [0, {k}], got {num_draft_tokens!r}")
    if len(generators) != b:
        raise ValueError(f"generators must have one entry per row ({b}), got {len(generators)}")
    return b, k, vocab
