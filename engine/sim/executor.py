"""The simulated executor: the real engine's scheduler, KV cache manager and output
path, with the model's forward pass replaced by the timing model. A step waits its
modelled time on the engine's clock (real time in a server, virtual time in
`kvpilot sim`) and returns deterministic tokens. No weights are loaded and the KV
cache's bytes are never allocated: only the block bookkeeping is real.

Speculative decoding (speculative_config, either method): SimulatedSpeculator drafts
from the simulator's own token stream, each draft right with probability
simulate.spec_acceptance (speculation.py), and a step verifies them here: a decode that
carries K' drafts is one sequence with a (1 + K')-token query, so it costs 1 + K' rows
of GEMM compute and LM head but reads its KV once, and yields the accepted drafts plus
one token; the tokens are those it would have produced one step at a time. A draft
model's passes (simulate.spec_draft_cost) are added to the step that verifies them.

With tensor_parallel_size N (parallel.py) the executor is one engine over N GPUs: its KV
cache is the N GPUs' together (block bookkeeping is per engine, as in the real driver, and
each block spans every GPU's share of the KV heads), and each step costs one GPU's share
plus the all-reduces."""

from __future__ import annotations

import logging

from ..config.engine import EngineConfig
from ..core.executor import StepResult
from ..core.scheduler import SchedulerOutput
from ..core.tokenizer import Tokenizer
from .hardware import Accelerator, resolve_accelerator
from .parallel import SINGLE_GPU, TensorParallel, tensor_parallel
from .shapes import ModelShape, resolve_model_shape
from .speculation import SimulatedDrafts, draft_cost, draft_time
from .timing import QUERY_TILE, BatchShape, MemoryPlan, StepTimer, plan_memory
from .tokenizer import simulated_tokenizer
from .tokens import TokenSource

TFLOP, GB = 1e12, 1e9
log = logging.getLogger("kvpilot.sim")


def _token_range(tokenizer: Tokenizer) -> tuple[int, int]:
    """Ordinary (non-special) token ids, where they are contiguous: after the special
    ids when those come first (the tiny tokenizer), before them when they come last
    (Llama 3's 128000+)."""
    special = tokenizer.all_special_ids
    vocab = tokenizer.vocab_size
    if not special:
        return 0, vocab
    if max(special) < vocab // 2:
        return max(special) + 1, vocab
    return 0, min(special)


class SimulatedExecutor:
    def __init__(self, config: EngineConfig, clock, model: ModelShape, accelerator: Accelerator,
                 tokenizer: Tokenizer, parallel: TensorParallel = SINGLE_GPU) -> None:
        sim = config.simulate
        self.config, self.clock = config, clock
        self.model, self.accelerator, self.tokenizer = model, accelerator, tokenizer
        self.parallel = parallel
        self.vocab_size = model.vocab_size
        self.max_position_embeddings = model.max_position_embeddings
        # All KV heads and all weights: the engine's totals, whatever the GPUs it spans.
        self.kv_bytes_per_block = model.kv_bytes_per_token * config.block_size
        self.kv_cache_element_bytes = model.dtype_bytes
        self.weight_bytes = model.weight_bytes
        self.memory: MemoryPlan | None = None
        eos = min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else None
        self.tokens = TokenSource(*_token_range(tokenizer), eos, sim.output_lengths)
        self.drafts = SimulatedDrafts(self.tokens, sim.spec_acceptance)  # SimulatedSpeculator's source
        self.draft_cost = draft_cost(sim, config.speculative_config)
        self._step_time = StepTimer(model, accelerator, parallel)  # asked every step
        self.busy_s = 0.0  # modelled time spent in steps
        self.num_steps = 0
        self.overrun_s = 0.0  # host work past the modelled end of a step (a host too slow)
        self._last_end: float | None = None  # the previous step's end on the modelled timeline

    @classmethod
    def load(cls, config: EngineConfig, clock) -> SimulatedExecutor:
        sim = config.simulate
        model = resolve_model_shape(sim.model, config.dtype)
        acc = resolve_accelerator(
            sim.accelerator, sim.calibration, memory_bytes=sim.memory,
            bandwidth=sim.bandwidth_gbps * GB if sim.bandwidth_gbps else None,
            flops=sim.tflops * TFLOP if sim.tflops else None)
        parallel = tensor_parallel(config, model, acc)
        executor = cls(config, clock, model, acc, simulated_tokenizer(model.tokenizer_dir,
                                                                      model.max_position_embeddings), parallel)
        if sim.load_seconds:
            log.info("simulating model loading: %.0f s", sim.load_seconds)
            clock.sleep_until(clock.now() + sim.load_seconds)  # on a virtual clock, a jump
        return executor

    def describe(self) -> str:
        acc, tp = self.accelerator, self.parallel
        plan = f"; {self.memory.describe()}" if self.memory else ""
        gpus = f"{tp.size}x " if tp.size > 1 else ""
        link = f", {tp.describe()}" if tp.size > 1 else ""
        return (f"SIMULATED {gpus}{acc.name} ({acc.memory_bytes / 2**30:.0f} GiB, "
                f"{acc.bandwidth / GB:.0f} GB/s, {acc.flops / TFLOP:.0f} TFLOP/s{link}) serving "
                f"{self.model.name} in {self.model.dtype} ({self.model.num_params / 1e9:.2f}B "
                f"parameters){plan}")

    def kv_cache_budget(self) -> int:
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory
        self.memory = plan_memory(self.model, self.accelerator, self.config.gpu_memory_utilization,
                                  self.config.max_num_batched_tokens, self.config.max_num_seqs, self.parallel)
        return self.memory.kv_cache_bytes

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Nothing to allocate: the KV cache manager's block bookkeeping is the cache."""

    def release_loader_threads(self) -> None:
        pass  # no torch, no thread pools

    def failure(self) -> str | None:
        return None  # one process, nothing to lose

    def shutdown(self) -> None:
        pass  # no other processes

    def counters(self) -> dict[str, float]:
        return {"simulated_steps": float(self.num_steps), "simulated_busy_seconds": self.busy_s,
                "simulated_overrun_seconds": self.overrun_s}

    def make_generator(self, seed: int) -> None:
        return None  # tokens are a function of the request's seed and position

    def _wait_step(self, duration: float, started_at: float, follows_previous: bool) -> None:
        """Count a step of `duration` and wait for its end on the engine's clock."""
        self.busy_s += duration
        self.num_steps += 1
        # A busy engine's steps follow each other on the modelled timeline: the host work in
        # between (outputs, streaming, scheduling) is hidden behind the accelerator, as on
        # real hardware. After an idle spell the step starts when it is scheduled. Host
        # work longer than the step is counted, and the timeline restarts from it.
        follows = follows_previous and self._last_end is not None
        deadline = (self._last_end if follows else started_at) + duration
        now = self.clock.now()
        if now > deadline:
            self.overrun_s += now - deadline
            deadline = now
        self.clock.sleep_until(deadline)
        self._last_end = deadline

    def decode_time(self, num_seqs: int, context_tokens: int) -> float:
        """The modelled time of a step in which each of `num_seqs` sequences decodes one token
        (sampled), with `context_tokens` in all after it."""
        return self._step_time.decode(num_seqs, context_tokens)

    def run_decode(self, num_seqs: int, context_tokens: int, started_at: float, follows_previous: bool) -> None:
        """What run() does for such a step, less choosing the tokens: the fleet's fast-forward
        (engine/fleet/fast_forward.py) draws those itself."""
        self._wait_step(self.decode_time(num_seqs, context_tokens), started_at, follows_previous)

    def run(self, out: SchedulerOutput) -> StepResult:
        sampled, drafted = [], []
        logit_rows = passes = 0
        # The batch's shape, summed as BatchShape.of sums it (inlined: per sequence per step).
        num_tokens = pairs = reads = 0
        for item in out.scheduled:
            req = item.request
            new = item.num_new_tokens
            end = req.num_computed_tokens + new
            # Drafts are part of num_new_tokens: BatchShape.of prices a (1 + K')-token query
            # as 1 + K' GEMM rows, causal attention pairs among them, and one read of the
            # sequence's K/V (per 128-query tile), as a verification pass costs.
            num_tokens += new
            if new == 1:
                pairs += end
                reads += end
            else:
                pairs += new * (end - new) + new * (new + 1) // 2
                reads += end * -(-new // QUERY_TILE)
            k = len(item.spec_token_ids)
            if end - k == len(req.prompt_token_ids) + len(req.output_token_ids):  # item.samples, inlined
                sampled.append(item)
                logit_rows += 1 + k  # the LM head and sampling run on every verified row
                if k:
                    drafted.append(end - k)
                    passes = max(passes, k)
        # num_sampled: logit rows, which is sequences sampled when nothing is drafted.
        shape = BatchShape(len(out.scheduled), num_tokens, logit_rows, pairs, reads)
        duration = self._step_time(shape)
        if drafted:
            duration += draft_time(self.model, self.accelerator, drafted, passes, self.draft_cost, self.parallel)
        self._wait_step(duration, out.started_at, out.follows_previous)
        requests = [item.request for item in sampled]
        if drafted:
            token, verify = self.tokens.token, self.drafts.verify
            tokens = []
            for item in sampled:
                r, p = item.request, item.request.sampling_params
                if item.spec_token_ids:  # the accepted drafts and one more
                    tokens.append(verify(r, item.spec_token_ids))
                else:
                    tokens.append([token(r.seed, len(r.output_token_ids), p.ignore_eos, p.min_tokens)])
        else:
            tokens = self.tokens.next_tokens(requests)
        logprobs = None
        if any(r.sampling_params.logprobs is not None for r in requests):
            lp = self.tokens.logprob
            logprobs = [[lp(r.seed, len(r.output_token_ids) + i, t, r.sampling_params.logprobs or 0)
                         for i, t in enumerate(ts)] for r, ts in zip(requests, tokens)]
        return StepResult(requests, tokens, logprobs)
