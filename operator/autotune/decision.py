"""The policy's vocabulary: what is being tuned (Settings), within what (Bounds), the
thresholds it judges by (Thresholds), and what it answers (Decision)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

SETTINGS = ("max_num_seqs", "max_model_len", "replicas", "num_speculative_tokens")


class Diagnosis(str, Enum):
    PREEMPTION_BOUND = "PreemptionBound"  # the engine recomputes evicted sequences
    SCHEDULER_BOUND = "SchedulerBound"  # queueing while the KV cache has room: max_num_seqs binds
    KV_CACHE_BOUND = "KVCacheBound"  # queueing with the cache full and lengths far below max_model_len
    LENGTH_BOUND = "LengthBound"  # requests refused for length
    TPOT_BOUND = "TPOTBound"  # TPOT p95 above the objective: the decode batch is too wide
    HARDWARE_BOUND = "HardwareBound"  # queueing with no tuning headroom left
    HEALTHY = "Healthy"
    IDLE = "Idle"
    NO_DATA = "NoData"


class Action(str, Enum):
    CHANGE = "change"  # a new setting the caller applies (Auto) or reports (Recommend)
    REVERT = "revert"  # undo the last change: its verification found its signal worse
    HOLD = "hold"  # nothing to do, or not allowed to act now (the reason says which)


@dataclass(frozen=True)
class Settings:
    """What is in effect now (the operator's effective settings)."""

    max_num_seqs: int
    max_model_len: int
    replicas: int
    block_size: int = 16
    max_num_batched_tokens: int | None = None  # max_num_seqs may not exceed it
    hpa_owns_scale: bool = False  # an HPA owns the replica count: leave replicas alone
    num_speculative_tokens: int | None = None  # K in effect; None: the engine does not speculate


@dataclass(frozen=True)
class Range:
    min: int
    max: int

    def __post_init__(self) -> None:
        if self.min > self.max:
            raise ValueError(f"range min {self.min} > max {self.max}")

    def clamp(self, value: int) -> int:
        return max(self.min, min(self.max, value))


@dataclass(frozen=True)
class Bounds:
    """The spec's bounds: autotune.maxNumSeqs, autotune.maxModelLen, autoscaling min/max, and
    autotune.numSpeculativeTokens (None without engine.speculative)."""

    max_num_seqs: Range
    max_model_len: Range
    replicas: Range
    num_speculative_tokens: Range | None = None
    max_num_batched_tokens: Range | None = None  # None: the chunk budget is not tuned

    def of(self, setting: str) -> Range:
        return getattr(self, setting)

    def clamp_settings(self, cur: Settings) -> dict[str, tuple[int, int]]:
        """setting -> (value, clamped) for each tuned setting outside its range (replicas
        not while an HPA owns them; speculation only where configured)."""
        out = {}
        for k in ("max_num_seqs", "max_model_len", "replicas", "num_speculative_tokens", "max_num_batched_tokens"):
            if k == "replicas" and cur.hpa_owns_scale:
                continue
            v, r = getattr(cur, k), self.of(k)
            if v is not None and r is not None and r.clamp(v) != v:
                out[k] = (v, r.clamp(v))
        return out


@dataclass(frozen=True)
class Thresholds:
    """Every number the policy judges by. Pairs of enter/exit levels give hysteresis: a
    condition starts at the enter level and, once it was the diagnosis, holds until the
    signal crosses the (easier) exit level."""

    # Preemption: rate(vllm:num_preemptions_total), deployment-wide, per second, and per
    # finished request (a busy deployment preempts more per second for the same harm).
    preempt_enter_per_s: float = 0.1
    preempt_exit_per_s: float = 0.02
    preempt_per_request_enter: float = 0.1
    preempt_per_request_exit: float = 0.05
    # The user's TPOT objective (p95 of each request's mean time per output token), from
    # spec.autotune.objectives.tpot; None turns the TPOT rules off.
    tpot_objective_s: float | None = None
    # The user's TTFT objective (p95 time to first token), from spec.autotune.objectives.ttft.
    # Set, a queue is pressure only while its queue-time p95 is at least ttft_enter_ratio x
    # it (ttft_exit_ratio once queueing): a wait that keeps the first token well inside the
    # objective costs the user nothing, and a replica for it is waste (prefill time, which
    # no replica shortens, is left out). A scale-in keeps that p95, grown with the load each
    # replica left carries, under ttft_scale_in_ratio x it.
    ttft_objective_s: float | None = None
    # The share of requests the user wants within the objectives (objectives.attainment). A
    # scale-out goes ahead when it can raise good requests per GPU-hour (payoff.py) or while
    # fewer than this share meet the objectives; None: only when it can pay for itself.
    attainment: float | None = None
    payoff_min_requests: int = 50
    # ... below it the share is judged at its upper confidence bound, this many standard
    # errors above what the window reads (Wilson's score bound: sound at a handful of requests).
    payoff_small_sample_z: float = 2.0
    # A scale-out that went ahead on the miss share goes back when its grown fleet makes more
    # than this share fewer good requests/s per replica than before it (payoff.py).
    payoff_verify_margin: float = 0.1
    # ... and the share of the misses it made good stands for the upper bound this long.
    payoff_memory_s: float = 3600.0
    # A miss share that rose from interval to interval over this many intervals is carried on
    # at its pace over a replica's start-up (forecast_lead_s) before judging a scale-out
    # (payoff.py).
    payoff_trend_points: int = 3
    payoff_trend_z: float = 2.0  # ... by more than this many times it moves by chance,
    payoff_trend_min_history: int = 6  # ... known from this many earlier windows at least
    ttft_enter_ratio: float = 0.5
    ttft_exit_ratio: float = 0.35
    ttft_scale_in_ratio: float = 0.5
    # Narrowing aims at objective x tpot_target_ratio; max_num_seqs is not raised while TPOT
    # p95 is above objective x tpot_raise_ratio. Between the two lies the dead band that
    # keeps the batch from see-sawing (stock vLLM's TPOT buckets are coarse: 25/50/75 ms).
    tpot_target_ratio: float = 0.9
    tpot_raise_ratio: float = 0.9
    # Queueing: p95 of vllm:request_queue_time_seconds, or mean requests waiting (all pods).
    # The exit level is vLLM's lowest queue-time bucket (0.3 s): a stock vLLM pod whose
    # queue has emptied reads p95 = 0.95 x 0.3 s by interpolation, which must count as calm.
    queue_enter_s: float = 0.5
    queue_exit_s: float = 0.3
    waiting_enter: float = 2.0
    waiting_exit: float = 0.5
    # KV cache "full": mean of vllm:kv_cache_usage_perc over pods and the window.
    kv_full_enter: float = 0.90
    kv_full_exit: float = 0.80
    # KV cache "low": the max over pods and the window (a peak below it is spare memory).
    kv_low_enter: float = 0.50
    kv_low_exit: float = 0.65
    # Raising max_num_seqs never projects the peak KV usage above this.
    kv_raise_target: float = 0.85
    # max_num_seqs binds when the mean running count is at least this fraction of it.
    running_at_cap: float = 0.9
    # Idle: completions and requests in flight (running + waiting) below these.
    idle_rate_per_s: float = 0.01
    idle_inflight: float = 0.1
    idle_windows: int = 3  # consecutive idle intervals before a replica is removed
    scale_out_windows: int = 2  # consecutive queue-bound intervals before a replica is added
    # Length refusals above this many per second and this share of the traffic mean
    # max_model_len is too short (a stray over-long request is the client's, not the setting's).
    refusal_enter_per_s: float = 0.0
    refusal_enter_share: float = 0.01
    # Step sizes.
    seq_decrease: float = 0.75  # max_num_seqs x this when preempting ...
    seq_max_decrease: float = 0.5  # ... or toward the capacity bound, but never below x this
    seq_increase: float = 1.5
    len_headroom: float = 1.25  # max_model_len target = p99 length x this, rounded up to blocks
    len_far_ratio: float = 0.5  # lower only when that target is <= max_model_len x this
    len_max_divisor: int = 4  # one step lowers max_model_len at most to 1/4
    len_increase: float = 2.0
    # Safety.
    cooldown_s: float = 120.0  # no change within this long after the last applied one
    flip_backoff_s: float = 600.0  # no retry of a reverted move, no re-lowering after a raise
    worse_rel: float = 0.2  # verification: worse = above baseline x (1 + worse_rel) + worse_abs
    worse_abs: dict = field(default_factory=lambda: {
        "preemptions_per_s": 0.05,
        "queue_time_p95_s": 0.1,
        "num_waiting": 1.0,
        "length_refusals_per_s": 0.01,
    })
    # A K change is made on a predicted gain of spec_gain_margin; its target (TPOT) may then
    # only get worse by noise. Drafts share each sequence's KV reads, which the rule's
    # rows-only cost model leaves out, so at long contexts it can call a paying K a loss.
    spec_worse_rel: float = 0.05
    revert_replicas: bool = False  # a worse queue after scale-out usually means more load
    # A max_num_seqs / max_model_len change made for preemption or queueing is also
    # reverted when output tokens/s fell by more than this fraction (it cost throughput).
    throughput_drop_rel: float = 0.15
    # A change whose target signal got worse is kept when output tokens/s rose by more than
    # this with requests still waiting: under an overload the queue grows whatever is done.
    throughput_gain_rel: float = 0.10
    # The deployment model (planner.py) sizes replicas and max_num_seqs where it can.
    planner: bool = False
    # A scale-in (the rules' or the model's) waits for calm intervals covering a replica's
    # start-up as seen here, at least scale_in_min_windows; scale_in_windows before a start-up
    # was seen (scale_in.py: calm_needed).
    scale_in_windows: int = 5
    scale_in_min_windows: int = 3
    # The model sizes capacity only when fitted on this many windows, fitting them within
    # this relative error, agreeing with the TPOT the deployment shows within this much,
    # and certain to this much where it plans to go; otherwise the rules decide.
    model_min_windows: int = 8
    # Rules' scale-in (scale_in.py): the replicas left may run at most this share of the cap,
    # with TPOT p95 now at most this share of the objective.
    scale_in_load: float = 0.7
    scale_in_load_margin: float = 0.7  # ... and carry at most this x the load a scale-out was made for
    scale_in_memory_s: float = 3600.0  # how long that load is remembered
    # The chunk budget (chunk.py) moves when at least this share of the tokens processed are
    # prompt tokens; it is raised for a queue only while TPOT p95 <= this x the objective.
    chunk_prompt_share: float = 0.5
    chunk_raise_tpot_ratio: float = 0.6
    # TPOT p95 read from a window in which load paused is acted on (the chunk budget only)
    # when at least this many requests finished in it.
    tpot_min_requests: int = 50
    scale_in_tpot_ratio: float = 0.8
    model_max_residual: float = 0.15
    model_max_disagreement: float = 0.2
    model_max_uncertainty: float = 0.2
    scale_out_cooldown_s: float = 15.0  # a planned scale-out may follow another after this
    # Capacity ahead of load (forecast.py): the traffic's period (autotune.season, a day; None:
    # no forecast), the points a period is kept at, the lead a new replica needs (its pod's
    # start-up and an interval) and how long after a rise the rules took to settle; a
    # forecast acts on a rise of forecast_rise x in the rate a period ago, to at least
    # forecast_min_rate req/s.
    season_s: float | None = None
    season_points: int = 96
    forecast_lead_s: float = 75.0
    forecast_settle_s: float = 300.0
    forecast_rise: float = 1.5
    forecast_min_rate: float = 0.5
    # Diagnose-only warning: prefix-cache hit rate below this while prompts share a prefix.
    prefix_hit_low: float = 0.2
    # Speculative decoding (speculation.py): a decode step costs about the same up to this many
    # rows (running sequences x (1 + K) per replica), then grows in proportion (a heuristic
    # compute-bound threshold; an H100 running an 8B model leaves the memory-bound regime at a
    # few hundred rows, and attention's own reads lower that).
    spec_compute_rows: float = 128.0
    # K moves only when the model predicts at least this much more output per unit of step time.
    spec_gain_margin: float = 0.1

    def ttft_pressure_level(self, queueing: bool) -> float | None:
        """The queue-time p95 below which a queue is no pressure: a share of the TTFT objective
        (None: no TTFT objective). Queue time, not TTFT: prefill, which no replica shortens, is
        left out."""
        if self.ttft_objective_s is None:
            return None
        return self.ttft_objective_s * (self.ttft_exit_ratio if queueing else self.ttft_enter_ratio)


DEFAULT_THRESHOLDS = Thresholds()


@dataclass(frozen=True)
class Decision:
    time: float
    diagnosis: Diagnosis
    action: Action
    reason: str
    change: dict = field(default_factory=dict)  # setting -> (old, new)
    target: str | None = None  # the MetricsSnapshot signal this change means to lower
    baseline: float | None = None  # its value when the change was decided
    throughput_baseline: float | None = None  # output tokens/s then, when the throughput guard applies
    verifies: float | None = None  # time of the earlier change this decision judged
    verified: bool | None = None  # that judgement: True kept, False got worse, None inconclusive
    planned_replicas: int | None = None  # the deployment model's replica count this interval
    # Good and finished requests/s per replica (payoff.py): a scale-out's before it (its replicas
    # go back if, once they serve, the fleet makes clearly fewer good ones per replica); that
    # return's, what the grown fleet made (how much of the misses a replica recovers).
    good_per_replica: float | None = None
    finished_per_replica: float | None = None

    @property
    def changes_something(self) -> bool:
        return self.action is not Action.HOLD and bool(self.change)
