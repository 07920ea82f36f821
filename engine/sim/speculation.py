"""Speculative decoding on the simulated accelerator: drafts of a set quality, verified
the way the real engine verifies greedy drafts, and charged in the step time.

There is no n-gram table worth matching and no draft model here: each draft token is
right (the token the simulator itself will produce at that output position) with
probability `acceptance` (SimulationConfig.spec_acceptance), decided by a hash of the
request's seed and the position, independently per position; a wrong draft is another
ordinary token. So a verification of K drafts yields (1 - a^(K+1)) / (1 - a) tokens on
average, the per-token acceptance model the autotuner's speculation rule reasons with,
and runs repeat exactly. Both methods (ngram, draft_model) draft this way; a draft model
loads no weights and takes no memory here, only time (`draft_cost`, below).

Verification keeps the drafts that equal the simulator's own next tokens, up to the
first that does not, and adds the simulator's token after them: the output is the same
token stream with or without speculation, as greedy output is on the real engine."""

from __future__ import annotations

from ..core.request import Request
from ..config.speculative import SpeculativeConfig
from ..config.simulation import SimulationConfig
from .hardware import Accelerator
from .parallel import SINGLE_GPU, TensorParallel
from .shapes import ModelShape
from .timing import BatchShape, step_time
from .tokens import TokenSource, mix64, uniform

_RIGHT_SALT = 0x5BEC_0001
_WRONG_SALT = 0x5BEC_0002
DRAFT_MODEL_COST = 0.1  # a draft model's pass / the target's: a ~10x smaller model (e.g. 1B for 8B)


def draft_cost(sim: SimulationConfig, spec: SpeculativeConfig | None) -> float:
    """One draft pass's time relative to a target decode step: the flag's, else 0 for
    n-gram lookup (host work, hidden behind the step) and DRAFT_MODEL_COST for a model."""
    if sim.spec_draft_cost is not None:
        return float(sim.spec_draft_cost)
    return DRAFT_MODEL_COST if spec is not None and spec.method == "draft_model" else 0.0


class SimulatedDrafts:
    def __init__(self, tokens: TokenSource, acceptance: float) -> None:
        self.tokens, self.acceptance = tokens, acceptance

    def _target(self, req: Request, index: int) -> int:
        """The simulator's token at output position `index` (as SimulatedExecutor.run's)."""
        p = req.sampling_params
        return self.tokens.token(req.seed, index, p.ignore_eos, p.min_tokens)

    def propose(self, req: Request, room: int) -> list[int]:
        """`room` drafts for the positions after the request's last (uncomputed) token."""
        t, first = self.tokens, len(req.output_token_ids)
        drafts = []
        for index in range(first, first + room):
            right = self._target(req, index)
            if uniform(req.seed, _RIGHT_SALT ^ index) < self.acceptance or t.span == 1:
                drafts.append(right)  # (one ordinary token only: no wrong one to draft)
                continue
            # Another ordinary token: an offset in [1, span) from the right one (any, when
            # the right one is EOS, outside the ordinary range).
            offset = 1 + mix64((req.seed << 22) ^ index ^ _WRONG_SALT) % (t.span - 1)
            base = right - t.low if t.low <= right < t.low + t.span else 0
            drafts.append(t.low + (base + offset) % t.span)
        return drafts

    def verify(self, req: Request, drafts: list[int]) -> list[int]:
        """The accepted drafts and one more token (1 + accepted tokens, in order; a stop
        token among them is for the scheduler's update to act on)."""
        first = len(req.output_token_ids)
        out = []
        for i, draft in enumerate(drafts):
            token = self._target(req, first + i)
            out.append(token)
            if token != draft:
                return out  # the target's own token replaces the first wrong draft
        out.append(self._target(req, first + len(drafts)))
        return out


def draft_time(model: ModelShape, acc: Accelerator, contexts: list[int], passes: int, cost: float,
               tp: TensorParallel = SINGLE_GPU) -> float:
    """A draft model's work before a verifying step: `passes` (the most drafts any request
    carries) batched decode passes over the drafted sequences (context lengths), each
    `cost` x the target's decode step of that shape (over the target's GPUs). Seconds."""
    if cost <= 0 or passes <= 0 or not contexts:
        return 0.0
    return passes * cost * step_time(model, acc, BatchShape.of([(1, end) for end in contexts]), tp)
