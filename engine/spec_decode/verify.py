"""One step's sampling when some requests carry draft tokens (speculative decoding).

The forward pass already ran every draft through the target as a multi-token query, so
each drafted request has 1 + K' rows of logits: its last token's (which verifies draft 1)
and one per draft (the last one's gives the bonus token). Requests without drafts sample
their one row with the ordinary sampler, penalties and all; drafted requests are verified
by rejection sampling (rejection_sampler.py), which keeps the target's distribution
exactly and, for greedy rows, its tokens.

Only requests the proposer found eligible carry drafts: no penalties (their counts would
change within the step) and min_tokens reached (the stop-token mask would too)."""

from __future__ import annotations

import torch

from ..sample.argmax_rows import argmax_rows
from ..core.executor import StepResult
from ..core.outputs import TokenLogprob
from ..sample.rejection_sampler import rejection_sample
from ..core.request import Request
from ..sample.sampler import Sampler, SamplingBatch, processed_probs


def verify_step(logits_for, sample_rows: list[int], requests: list[Request],
                drafts: list[list[int]], sampler: Sampler, device: torch.device) -> StepResult:
    """Tokens (one per plain request, accepted drafts + one per drafted request) and
    the target's logprobs of each, in `requests` order."""
    plain = [i for i, d in enumerate(drafts) if not d]
    drafted = [i for i, d in enumerate(drafts) if d]
    tokens: list[list[int]] = [[] for _ in requests]
    logprobs: list[list[TokenLogprob]] | None = None
    if any(r.sampling_params.logprobs is not None for r in requests):
        logprobs = [[] for _ in requests]

    if plain:
        logits = logits_for([sample_rows[i] for i in plain])  # [P, vocab]
        batch = SamplingBatch.build([requests[i] for i in plain], logits.shape[-1], device)
        out = sampler(logits, batch)
        ids = out.token_ids.tolist()
        for j, i in enumerate(plain):
            tokens[i] = [ids[j]]
        if logprobs is not None and out.logprob is not None:
            chosen, top_ids, top_lps = out.logprob.tolist(), out.top_ids.tolist(), out.top_logprobs.tolist()
            for j, i in enumerate(plain):
                logprobs[i] = [TokenLogprob(ids[j], chosen[j], list(zip(top_ids[j], top_lps[j])))]

    k = max(len(drafts[i]) for i in drafted)
    # Each drafted request's rows: its sample row, then one per draft.
    row_ids = [sample_rows[i] + j for i in drafted for j in range(len(drafts[i]) + 1)]
    logits = logits_for(row_ids)  # [R, vocab]
    expanded = [requests[i] for i in drafted for _ in range(len(drafts[i]) + 1)]
    batch = SamplingBatch.build(expanded, logits.shape[-1], device)
    argmax = argmax_rows(logits)  # [R]
    # Greedy rows verify against the argmax; their (temperature-1) probs go unused.
    probs = processed_probs(logits, batch)  # [R, vocab]

    # Pad to [B, K + 1]: position p of row b is flat row start[b] + p (clamped to its last).
    b = len(drafted)
    counts = torch.tensor([len(drafts[i]) for i in drafted])  # [B]
    starts = torch.cumsum(counts + 1, 0) - (counts + 1)  # [B]
    pos = torch.arange(k + 1)[None, :]  # [1, K + 1]
    flat = (starts[:, None] + torch.minimum(pos, counts[:, None])).to(device)  # [B, K + 1]
    draft_ids = torch.zeros(b, k, dtype=torch.long)
    for r, i in enumerate(drafted):
        draft_ids[r, :len(drafts[i])] = torch.tensor(drafts[i])
    greedy = torch.tensor([requests[i].sampling_params.greedy for i in drafted], device=device)
    verdict = rejection_sample(
        probs[flat], argmax[flat], draft_ids.to(device), counts.tolist(),
        _draft_probs([requests[i] for i in drafted], [drafts[i] for i in drafted], k, logits.shape[-1], device),
        greedy, [requests[i].sample.generator for i in drafted])
    for r, i in enumerate(drafted):
        tokens[i] = verdict.token_ids[r]

    if logprobs is not None:
        raw = torch.log_softmax(logits, dim=-1)  # [R, vocab]: the target's, unprocessed
        for r, i in enumerate(drafted):
            want = requests[i].sampling_params.logprobs
            if want is None:
                continue
            emitted = verdict.token_ids[r]
            at = raw[int(starts[r]): int(starts[r]) + len(emitted)]  # [E, vocab]
            chosen = at.gather(1, torch.tensor(emitted, device=device)[:, None]).squeeze(1).tolist()
            top_lps, top_ids = at.topk(max(want, 1), dim=-1) if want else (None, None)
            logprobs[i] = [TokenLogprob(t, chosen[e], list(zip(top_ids[e].tolist(), top_lps[e].tolist()))
                                        if want else [])
                           for e, t in enumerate(emitted)]
    return StepResult(requests, tokens, logprobs)


def _draft_probs(requests: list[Request], drafts: list[list[int]], k: int, vocab: int,
                 device: torch.device) -> torch.Tensor | None:
    """[B, K, vocab]: each row's draft distributions (a draft model's, kept on the request
    when it sampled), a point mass at the draft where it took the argmax, uniform past
    the row's drafts (never read); None for n-gram drafts, all point masses."""
    if all(r.spec.draft_probs is None for r in requests):
        return None
    q = torch.full((len(requests), k, vocab), 1.0 / vocab, device=device)
    for b, (req, row) in enumerate(zip(requests, drafts)):
        if req.spec.draft_probs is not None:
            q[b, :len(row)] = req.spec.draft_probs[:len(row)]  # the budget may have cut drafts
        else:
            q[b, :len(row)] = 0.0
            q[b, torch.arange(len(row)), torch.tensor(row)] = 1.0
    return q
