"""Speculative decoding's engine side: after each step, propose draft tokens for the
running requests (verified by the next step's forward pass, see spec_verify.py), and
count what was proposed and accepted, as vLLM's spec_decode metrics do."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.executor import StepResult
from ..core.kv_cache_manager import KVCacheManager
from ..core.request import Request, RequestStatus
from ..core.scheduler import SchedulerOutput
from ..config.speculative import SpeculativeConfig


@dataclass
class SpecDecodeStats:
    """Cumulative counters, named after vllm:spec_decode_*_total."""

    num_drafts: int = 0  # requests verified with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # one per draft position

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_pos))

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1


def check_num_speculative_tokens(value: object, ceiling: int) -> int:
    """A live value: 0 (off) up to the configured num_speculative_tokens (the ceiling: the
    positions the metrics and the step's shapes were set up for)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= ceiling:
        raise ValueError(f"num_speculative_tokens must be an integer in [0, {ceiling}] (the configured "
                         f"speculative_config.num_speculative_tokens), got {value!r}")
    return value


def eligible(req: Request) -> bool:
    """Whether a request may carry drafts: decoding (its last token is the one uncomputed),
    no penalties and min_tokens reached (both would change the target's distribution
    within the step, which one verification pass cannot follow)."""
    params = req.sampling_params
    return (req.status is RequestStatus.RUNNING
            and req.num_computed_tokens == req.num_tokens - 1
            and not params.has_penalties
            and len(req.output_token_ids) >= params.min_tokens)


def draft_room(req: Request, k: int) -> int:
    """Drafts a request may carry (0: none): up to k, and none past max_tokens, where a
    draft could never be emitted (max_tokens fits max_model_len, so no draft lacks a
    position). The request's last token is uncomputed, so one more comes with them."""
    return min(k, req.max_tokens - len(req.output_token_ids) - 1) if eligible(req) else 0


def drop_consumed(scheduled: SchedulerOutput) -> None:
    """Speculation's state after a step: a scheduled request's drafts were verified (or cut
    by the token budget) and are gone; a freed request (preempted, finished, aborted) lost
    its draft KV with its blocks: back in, it may hit cached blocks that some other
    request's target computed but whose draft KV nobody wrote. The scheduler reads drafts,
    never writes them, so this is where they end."""
    for item in scheduled.scheduled:
        item.request.spec.token_ids = []
    for req in scheduled.freed:
        req.spec.token_ids, req.spec.draft_probs, req.spec.draft_num_computed = [], None, 0


class NgramSpeculator:
    """Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of the
    sequence's last n tokens."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens  # live-tunable; 0 is off
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * config.num_speculative_tokens)

    def record(self, scheduled: SchedulerOutput, result: StepResult) -> None:
        """Count each verified request's drafts and how many the target accepted (before
        any stop cut the output); drop the drafts the step consumed, and all speculation
        state of requests whose blocks were freed (their draft KV went with them)."""
        drop_consumed(scheduled)
        drafted = {item.request: len(item.spec_token_ids) for item in scheduled.scheduled if item.spec_token_ids}
        if not drafted:
            return
        for req, tokens in zip(result.requests, result.token_ids):
            n = drafted.get(req)
            if n is not None:
                self.stats.record(n, len(tokens) - 1)

    def propose(self, running: list[Request]) -> None:
        k = self.num_speculative_tokens
        if k <= 0:
            return
        # numpy, where the real engine drafts: the simulated engine (the torch-free operator
        # image) drafts in its executor and never comes here.
        from .ngram_proposer import propose_ngram

        cfg = self.config
        for req in running:
            room = draft_room(req, k)
            if room <= 0:
                continue
            req.spec.token_ids = propose_ngram(req.all_token_ids, room, cfg.prompt_lookup_min,
                                               cfg.prompt_lookup_max)


class DraftModelSpeculator(NgramSpeculator):
    """Drafts from the executor's draft model: slots for them are reserved first (the
    draft writes its KV there before the target verifies); a request without room for
    them this step gets none."""

    def __init__(self, config: SpeculativeConfig, runner, kv_cache: KVCacheManager) -> None:
        super().__init__(config)
        self.runner, self.kv_cache = runner, kv_cache

    def propose(self, running: list[Request]) -> None:
        k = self.num_speculative_tokens
        if k <= 0:
            return
        chosen, counts = [], []
        for req in running:
            room = draft_room(req, k)
            if room > 0 and self.kv_cache.reserve_lookahead(req, 1 + room):
                chosen.append(req)
                counts.append(room)
        if chosen:
            self.runner.propose_drafts(chosen, counts)


class SimulatedSpeculator(NgramSpeculator):
    """Speculation on the simulated accelerator (config.simulate), for either method: each
    eligible running request gets `draft_room` drafts from the simulator's own token
    stream, each right with probability simulate.spec_acceptance, independently per
    position and fixed by the request's seed and the position (sim/speculation.py), so
    runs repeat. No draft model is loaded (its `model` is never read): its passes are
    charged as time only (simulate.spec_draft_cost), and no KV is reserved ahead for them:
    the scheduler allocates the draft slots with the step that verifies them, as for
    n-gram drafts. The simulated executor verifies (sim/executor.py)."""

    def __init__(self, config: SpeculativeConfig, drafts) -> None:
        super().__init__(config)
        self.drafts = drafts  # the executor's SimulatedDrafts

    def propose(self, running: list[Request]) -> None:
        k = self.num_speculative_tokens
        if k <= 0:
            return
        for req in running:
            room = draft_room(req, k)
            if room > 0:
                req.spec.token_ids = self.drafts.propose(req, room)


def make_speculator(config, runner, kv_cache: KVCacheManager) -> NgramSpeculator | None:
    """The engine's proposer for `config.speculative_config` (an EngineConfig's), if any."""
    spec = config.speculative_config
    if spec is None:
        return None
    if config.simulate is not None:
        return SimulatedSpeculator(spec, runner.drafts)
    if spec.method == "draft_model":
        return DraftModelSpeculator(spec, runner, kv_cache)
    return NgramSpeculator(spec)
