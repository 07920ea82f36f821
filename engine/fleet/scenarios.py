"""Named, seeded traffic scenarios for the simulator and the autotuner contest: a day of
changing traffic, and the field guide's failure cases as short runs. Each names the
accelerator and model it is meant for, the settings it starts from, and the objective
each phase is judged by (a batch phase only wants its requests done)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..config.engine import EngineConfig
from ..config.simulation import SimulationConfig
from .trace import Phase, TraceRequest, generate


@dataclass(frozen=True)
class Slo:
    """A request is good when it finished and met every objective given (None: no limit)."""

    ttft_s: float | None = 2.0
    tpot_s: float | None = 0.050

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"slo {name} must be positive or None, got {v!r}")

    def met(self, ttft: float | None, tpot: float | None, ok: bool) -> bool:
        if not ok or ttft is None:
            return False
        if self.ttft_s is not None and ttft > self.ttft_s:
            return False
        # vLLM records TPOT 0 for a one-token answer: nothing to judge, so it passes.
        return self.tpot_s is None or (tpot or 0.0) <= self.tpot_s

    def __str__(self) -> str:
        parts = [f"TTFT<={self.ttft_s:g}s" if self.ttft_s else "", f"TPOT<={1000 * self.tpot_s:g}ms" if self.tpot_s else ""]
        return " ".join(p for p in parts if p) or "completion only"


INTERACTIVE = Slo()
THROUGHPUT_ONLY = Slo(ttft_s=None, tpot_s=None)


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    accelerator: str
    model: str
    phases: tuple[Phase, ...]
    slos: tuple[Slo, ...]  # one per phase
    # Where every contender starts: what a user gets by leaving the settings alone (or,
    # for a failure case, the mistake the case is about).
    max_num_seqs: int = 256
    max_model_len: int = 32768
    max_num_batched_tokens: int = 8192
    replicas: int = 1
    max_replicas: int = 1  # what an autoscaler may go up to (a failure case is about one GPU's settings)
    seed: int = 0
    # A client gives up (and the request counts as failed) when no token has come this many
    # seconds after it was sent; None: clients wait for ever.
    client_timeout_s: float | None = None
    # A replayed trace (trace_formats) instead of the phases' generated traffic; the phases
    # then only mark stretches of it to judge apart (a split's first part and the rest).
    requests: tuple[TraceRequest, ...] | None = field(default=None, repr=False, compare=False)
    # The traffic's period (a day), when it repeats: what an autotuner may be told to learn
    # a daily pattern over (None: not known to repeat).
    season_s: float | None = None

    def __post_init__(self) -> None:
        if len(self.slos) != len(self.phases):
            raise ValueError(f"scenario {self.name}: one slo per phase ({len(self.phases)}), got {len(self.slos)}")

    @property
    def duration(self) -> float:
        return sum(p.duration for p in self.phases)

    def boundaries(self) -> list[tuple[str, float, float]]:
        """(phase name, start, end) in trace seconds."""
        out, t = [], 0.0
        for p in self.phases:
            out.append((p.name, t, t + p.duration))
            t += p.duration
        return out

    def phase_index(self, t: float) -> int:
        for k, (_, start, end) in enumerate(self.boundaries()):
            if start <= t < end:
                return k
        return len(self.phases) - 1

    def trace(self) -> list[TraceRequest]:
        if self.requests is not None:
            return list(self.requests)
        # Lengths are clipped to the model's context, not to the starting max_model_len: a
        # request longer than the deployment allows is part of the traffic, and refused.
        return list(generate(list(self.phases), seed=self.seed, max_len=131072))

    def engine_config(self, **overrides) -> EngineConfig:
        settings = dict(model=None, dtype="bfloat16", simulate=SimulationConfig(self.accelerator, self.model),
                        max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                        max_num_batched_tokens=self.max_num_batched_tokens)
        settings.update(overrides)
        return EngineConfig(**settings)

    def repeated(self, days: int) -> Scenario:
        """The same day `days` times back to back (each day's requests drawn afresh from the
        same phases), its period the season: a day of history before the day judged."""
        if not isinstance(days, int) or not 1 <= days <= 14:
            raise ValueError(f"days must be an integer in [1, 14], got {days!r}")
        if days == 1:
            return self
        day = self.duration
        requests = self.requests and tuple(replace(r, arrival=r.arrival + k * day)
                                           for k in range(days) for r in self.requests)
        phases = tuple(replace(p, name=f"{p.name}{'' if k == days - 1 else f'@{k + 1}'}")
                       for k in range(days) for p in self.phases)
        return replace(self, name=f"{self.name}-x{days}d", phases=phases, slos=self.slos * days,
                       requests=requests, season_s=day)

    def scaled(self, time_factor: float) -> Scenario:
        """The same traffic with every phase `time_factor` as long (rates unchanged): the
        compressed run for a real-time cluster, or a short test."""
        if not 0 < time_factor <= 1000:
            raise ValueError(f"time_factor must be in (0, 1000], got {time_factor!r}")
        requests = self.requests and tuple(replace(r, arrival=r.arrival * time_factor) for r in self.requests)
        return replace(self, phases=tuple(replace(p, duration=p.duration * time_factor) for p in self.phases),
                       requests=requests, season_s=self.season_s and self.season_s * time_factor)


def from_trace(name: str, requests: list[TraceRequest], slo: Slo = INTERACTIVE, base: Scenario | None = None,
               **settings) -> Scenario:
    """A replayed trace as a scenario of one phase, judged by one objective; the accelerator,
    model and starting settings from `base` (the day's), each overridable."""
    if not requests:
        raise ValueError("trace: no requests to replay")
    end = max(r.arrival for r in requests) + 1e-6
    phases = (Phase(name="trace", duration=end, rate=0),)
    base = base or DAY
    return replace(base, name=name, summary=f"replayed trace {name}", phases=phases,
                   slos=(slo,) * len(phases), requests=tuple(requests), **settings)


CHAT = dict(input="lognormal:800:0.8", output="lognormal:200:0.7")

# A day, compressed: the phases keep their order, rates and request shapes; each lasts
# minutes instead of hours so the whole day and a sweep over it run in minutes.
DAY = Scenario(
    name="day",
    summary="a day of traffic on H100 80GB serving Llama-3.1-8B (bf16): chat, RAG, a burst, a quiet "
            "hour, an overnight batch",
    accelerator="h100-80gb", model="llama-3.1-8b",
    phases=(
        Phase(name="chat", duration=600, rate=24, **CHAT),
        Phase(name="rag", duration=600, rate=3, input="uniform:4096:16384", output="lognormal:150:0.5",
              prefix_len=2048, prefix_groups=4, prefix_fraction=0.5),
        Phase(name="burst", duration=300, rate=72, burstiness=0.5, **CHAT),
        Phase(name="quiet", duration=600, rate=0.1, **CHAT),
        # Sent as OpenAI's "flex" tier, as a batch job would: it asks for no latency.
        Phase(name="batch", duration=600, rate=16, input="lognormal:1500:0.5", output="lognormal:400:0.5",
              service_tier="flex"),
    ),
    slos=(INTERACTIVE, INTERACTIVE, INTERACTIVE, INTERACTIVE, THROUGHPUT_ONLY),
    max_replicas=8, seed=1,
)

# (a) The field guide's "throughput collapses; lower max_num_seqs": max_num_seqs 256 on a
# GPU whose cache holds ~26.6k tokens, about 75 of these sequences half-way through.
PREEMPTION = Scenario(
    name="preemption",
    summary="(a) max_num_seqs 256 on an A10G whose KV cache fits ~75 chat sequences",
    accelerator="a10g", model="llama-3.1-8b",
    phases=(Phase(name="overload", duration=600, rate=3.0, input="lognormal:250:0.6", output="lognormal:300:0.6"),),
    slos=(INTERACTIVE,), max_num_seqs=256, max_model_len=8192, seed=2,
)

# (b) max_model_len left at 32768 while the median request is ~1,200 tokens, on an L40S
# whose cache fills under this load.
LONG_MAX_MODEL_LEN = Scenario(
    name="long-max-model-len",
    summary="(b) max_model_len 32768 with a median request of ~1,200 tokens, L40S at full load",
    accelerator="l40s", model="llama-3.1-8b",
    phases=(Phase(name="chat", duration=900, rate=6.0, input="lognormal:900:0.5", output="lognormal:300:0.5"),),
    slos=(INTERACTIVE,), max_num_seqs=256, max_model_len=32768, seed=3,
)

# (c) The cache at ~20 % with requests queueing: max_num_seqs binds first.
SCHEDULER_BOUND = Scenario(
    name="scheduler-bound",
    summary="(c) max_num_seqs 32 on an H100: the cache sits near 20 % while requests queue",
    accelerator="h100-80gb", model="llama-3.1-8b",
    phases=(Phase(name="chat", duration=600, rate=12, **CHAT),),
    slos=(INTERACTIVE,), max_num_seqs=32, max_model_len=32768, seed=4,
)

SCENARIOS = {s.name: s for s in (DAY, PREEMPTION, LONG_MAX_MODEL_LEN, SCHEDULER_BOUND)}


def scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"scenario must be one of {sorted(SCENARIOS)}, got {name!r}") from None
