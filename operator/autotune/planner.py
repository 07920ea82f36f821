"""The deployment model and the plan it gives: how many replicas, and how wide a batch
on each, serve the observed demand within the TPOT objective.

The model is fitted online from the deployment's own metrics, nothing else: per window
of steady load, per replica, the mean running sequences x, the prompt tokens processed
per second p, and the mean per-request TPOT y. On a GPU a decode step reads the weights
once (a fixed cost a) plus every running sequence's KV (b per sequence), and prompt
tokens take the accelerator away from decoding for c seconds each, so only a fraction
1 - c p of each second is left for decode steps:

    TPOT ~= (a + b x) / (1 - c p),   i.e.   y = a + b x + c (p y)

linear in (a, b, c), fitted by least squares on relative errors, weighted toward recent
windows (the traffic mix moves b and c), with a weak prior that splits the first
observation evenly between the three terms, so one window already gives a usable model
and every new operating point sharpens it.

The plan: the fewest replicas R (within bounds) whose width x* = the largest x with
TPOT(x, p/R) <= objective x target ratio (and whose sequences fit the KV cache) carries
the demand: R x x* / TPOT >= output tokens/s + the backlog drained over `drain_s`, with
headroom. max_num_seqs becomes x*: a wider batch would break the objective, a queue
beyond it is the replica count's job.

A window in which only requests of OpenAI's "flex" tier finished (a batch job) holds no
latency objective: x* is then as wide as the KV cache holds, where a replica makes the
most tokens per second, and the fewest replicas that carry the demand at that width are
planned."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .decision import Bounds, Settings, Thresholds
from .history import History, Observation
from .signals import MetricsSnapshot


@dataclass(frozen=True)
class PlannerSettings:
    half_life_s: float = 300.0  # weight of a window halves with this age
    prior_weight: float = 0.5  # the prior counts as this many windows
    headroom: float = 0.25  # scale out to carry demand x (1 + headroom)
    scale_in_headroom: float = 0.5  # scale in only when fewer replicas carry demand x (1 + this)
    flex_scale_in_headroom: float = 0.1  # the same for a flex-only window (which plans no headroom)
    drain_s: float = 30.0  # the queue at the window's end is served within this
    flex_drain_s: float = 600.0  # ... or this, in a flex-only window (a batch waits; GPUs cost)
    kv_fill: float = 0.9  # x* never plans the KV cache fuller than this
    seq_dead_band: float = 0.15  # max_num_seqs moves only when the plan differs by more
    min_spread: float = 0.6  # the mean TPOT is aimed at no less than this x the p95 objective


@dataclass(frozen=True)
class StepModel:
    a: float
    b: float
    c: float
    windows: int
    # How well it fits: the weighted RMS relative error over its windows, and the
    # coefficients' covariance in prior-scaled units (None: too few windows, or windows too
    # alike, to tell the three terms apart), with the scale those units use.
    residual: float = math.inf
    cov: tuple[tuple[float, ...], ...] | None = None
    scale: tuple[float, float, float] = (1.0, 1.0, 1.0)

    def uncertainty(self, running: float, prompt_tokens_per_s: float) -> float:
        """The relative standard error of the predicted TPOT at this operating point (inf
        when the data cannot tell)."""
        y = self.tpot(running, prompt_tokens_per_s)
        if self.cov is None or not math.isfinite(y) or y <= 0:
            return math.inf
        g = [self.scale[0] / y, running * self.scale[1] / y, prompt_tokens_per_s * self.scale[2]]
        var = sum(g[i] * self.cov[i][j] * g[j] for i in range(3) for j in range(3))
        return math.sqrt(max(var, 0.0))

    def tpot(self, running: float, prompt_tokens_per_s: float) -> float:
        left = 1.0 - self.c * prompt_tokens_per_s
        return (self.a + self.b * running) / left if left > 0 else math.inf

    def width_for(self, tpot_s: float, prompt_tokens_per_s: float) -> float:
        """The widest batch whose TPOT stays within tpot_s (0 when none does)."""
        room = tpot_s * (1.0 - self.c * prompt_tokens_per_s) - self.a
        if room <= 0:
            return 0.0
        return room / self.b if self.b > 0 else math.inf

    def __str__(self) -> str:
        fit = f"+/-{100 * self.residual:.0f}%" if math.isfinite(self.residual) else "unknown"
        return (f"TPOT ~= ({1000 * self.a:.1f}ms + {1000 * self.b:.3f}ms x running) / "
                f"(1 - {1e6 * self.c:.2f}us x prompt tok/s), per replica, fitted on {self.windows} windows "
                f"(residual {fit})")


def observation(s: MetricsSnapshot, replicas: int) -> Observation | None:
    """This window as a data point, when it is one of steady load with finished requests."""
    pods = s.serving(replicas)
    if (s.tpot_mean_s is None or not s.tpot_mean_s > 0 or not s.num_running or pods < 1
            or s.running_min is None or s.running_min < 0.5 or s.prompt_tokens_per_s is None):
        return None
    return Observation(s.time, s.num_running / pods, s.prompt_tokens_per_s / pods, s.tpot_mean_s)


def fit(history: History, now: float, ps: PlannerSettings = PlannerSettings()) -> StepModel | None:
    obs = history.observations
    if not obs:
        return None
    first = obs[0]
    # Prior: the first window's TPOT split evenly over the three terms, all >= 0.
    a0 = first.tpot_s / 3
    b0 = first.tpot_s / 3 / max(first.running, 1.0)
    c0 = 1 / 3 / max(first.prompt_tokens_per_s, 1.0)  # a third of each second on prompts
    prior = (a0, b0, c0)
    # Normal equations of weighted least squares in scaled coordinates (each coefficient
    # in units of its prior), plus the prior as pseudo-observations of each coefficient.
    scale = [max(v, 1e-12) for v in prior]
    ata = [[0.0] * 3 for _ in range(3)]
    aty = [0.0] * 3
    for o in obs:
        w = 0.5 ** ((now - o.time) / ps.half_life_s)
        row = [scale[0], o.running * scale[1], o.prompt_tokens_per_s * o.tpot_s * scale[2]]
        # Each row divided by its y, so the target is 1 and the error relative: a 5 ms miss
        # at 10 ms matters more than at 100 ms.
        row = [v / o.tpot_s for v in row]
        for i in range(3):
            aty[i] += w * row[i]
            for j in range(3):
                ata[i][j] += w * row[i] * row[j]
    data_only = [row[:] for row in ata]
    # Once the windows alone determine all three terms (non-negative), the prior steps
    # aside: its pull along a poorly covered direction would read as misfit.
    coef = _solve(data_only, aty) if len(obs) > 3 else None
    if coef is None or min(coef) < 0:
        for i in range(3):
            ata[i][i] += ps.prior_weight
            aty[i] += ps.prior_weight * 1.0
        coef = _solve(ata, aty)
    if coef is None:
        return None
    a, b, c = (max(coef[i] * scale[i], 0.0) for i in range(3))
    if a + b <= 0:
        return None
    residual, cov = _fit_quality(obs, now, ps, scale, coef, data_only)
    return StepModel(a, b, c, len(obs), residual, cov, tuple(scale))


def _fit_quality(obs, now: float, ps: PlannerSettings, scale: list[float], coef: list[float],
                 data_only: list[list[float]]):
    """(weighted RMS relative error, covariance of the scaled coefficients from the data
    alone, or None when they do not determine all three)."""
    sw = sw2 = sse = 0.0
    for o in obs:
        w = 0.5 ** ((now - o.time) / ps.half_life_s)
        row = [scale[0] / o.tpot_s, o.running * scale[1] / o.tpot_s, o.prompt_tokens_per_s * scale[2]]
        r = sum(row[i] * coef[i] for i in range(3)) - 1.0
        sw, sw2, sse = sw + w, sw2 + w * w, sse + w * r * r
    residual = math.sqrt(sse / sw) if sw > 0 else math.inf
    n_eff = sw * sw / sw2 if sw2 > 0 else 0.0
    if n_eff <= 3.5:
        return residual, None
    # A floor on the noise: a perfect fit of a few windows is luck, not certainty.
    s2 = max(sse / sw * n_eff / (n_eff - 3), 0.02 ** 2)
    cols = [_solve(data_only, [1.0 if k == i else 0.0 for k in range(3)]) for i in range(3)]
    if any(col is None for col in cols):
        return residual, None
    cov = tuple(tuple(s2 * cols[j][i] for j in range(3)) for i in range(3))
    if any(cov[i][i] < 0 for i in range(3)):
        return residual, None
    return residual, cov


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting (3 x 3)."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= f * a[col][k]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x


@dataclass(frozen=True)
class Plan:
    replicas: int
    max_num_seqs: int
    reason: str
    uncertainty: float = math.inf  # the model's relative error at the planned operating point


def _p95_after(s: MetricsSnapshot, cur: Settings, replicas: int, model: StepModel) -> float:
    """TPOT p95 at `replicas`, scaled from the observed p95 by the model's ratio: the model
    gives the relative change, the measurement the level (so a model fitted on other
    traffic cannot talk a scale-in into a broken objective)."""
    pods = s.serving(cur.replicas)
    if not s.tpot_p95_s or not s.num_running:
        return 0.0
    x, p = s.num_running / pods, (s.prompt_tokens_per_s or 0.0) / pods
    now = model.tpot(x, p)
    k = pods / replicas
    return s.tpot_p95_s * model.tpot(x * k, p * k) / now if now > 0 else math.inf


def kv_width(s: MetricsSnapshot, ps: PlannerSettings) -> float:
    """Sequences that fit the smallest pod's cache at the observed mean length: the finished
    requests' own, else tokens processed per finished request (which a phase change skews:
    the new phase's prompts are processed long before its requests finish)."""
    if not s.kv_cache_bytes or not s.kv_bytes_per_token or not s.request_rate_per_s:
        return math.inf
    if s.prompt_len_mean and s.generation_len_mean:
        per_request = s.prompt_len_mean + s.generation_len_mean
    else:
        per_request = ((s.prompt_tokens_per_s or 0.0) + (s.generation_tokens_per_s or 0.0)) / s.request_rate_per_s
    if per_request <= 0:
        return math.inf
    return ps.kv_fill * s.kv_cache_bytes / s.kv_bytes_per_token / per_request


def latency_free(s: MetricsSnapshot) -> bool:
    """Whether every request that finished in the window asked for no latency ("flex")."""
    return s.tpot_p95_s is None and (s.flex_share or 0.0) > 0


def plan(s: MetricsSnapshot, cur: Settings, bounds: Bounds, model: StepModel, t: Thresholds,
         ps: PlannerSettings = PlannerSettings()) -> Plan | None:
    """The replica count and batch width for the demand this window shows, or None when
    the objective or the demand is unknown."""
    if t.tpot_objective_s is None or not s.generation_tokens_per_s or not s.request_rate_per_s:
        return None
    throughput_only = latency_free(s)
    # The objective is on the p95 of per-request TPOT, the model on the mean: aim the mean
    # at the objective scaled by this window's mean/p95 (prompts stretch some requests more).
    # Bounded: under a backlog the p95 runs away from the mean for reasons width cannot fix.
    spread = (s.tpot_mean_s / s.tpot_p95_s) if s.tpot_mean_s and s.tpot_p95_s else 1.0
    goal_p95 = t.tpot_objective_s * t.tpot_target_ratio
    goal = goal_p95 * min(1.0, max(ps.min_spread, spread))
    # Tokens processed per finished request: above the requests' own lengths while a ramp's
    # requests are in flight, which plans a ramp's capacity before its requests finish.
    out_per_request = s.generation_tokens_per_s / s.request_rate_per_s
    prompt_per_request = (s.prompt_tokens_per_s or 0.0) / s.request_rate_per_s
    waiting_now = s.num_waiting_now or 0.0
    # Arrivals: what finished plus how fast the queue grew (its end against its mean, which
    # sits half a window back); a growing queue is demand the served rate does not show, and
    # a shrinking one is a backlog served in the window, which the served rate overstates.
    growth = 2.0 * (waiting_now - (s.num_waiting or 0.0)) / s.window_s
    arrivals = max(0.0, s.request_rate_per_s + growth)
    drain_s = ps.flex_drain_s if throughput_only else ps.drain_s
    drain = waiting_now / drain_s
    demand = (arrivals + drain) * out_per_request
    prompt = (arrivals + drain) * prompt_per_request
    kv_cap = kv_width(s, ps)
    # Never zero: going to zero is the idle rule's (scale_to_zero.py), and width(0) divides by it.
    lo, hi = (cur.replicas, cur.replicas) if cur.hpa_owns_scale else (max(1, bounds.replicas.min),
                                                                       max(1, bounds.replicas.max))

    def width(r: int) -> float:
        if throughput_only:  # the widest batch makes the most tokens/s; no TPOT to keep
            return min(kv_cap, bounds.max_num_seqs.max)
        return min(model.width_for(goal, prompt / r), kv_cap, bounds.max_num_seqs.max)

    def step_s(r: int) -> float:
        return model.tpot(width(r), prompt / r) if throughput_only else goal

    def carries(r: int, margin: float) -> bool:
        x = width(r)
        return x >= 1 and r * x / step_s(r) >= demand * (1 + margin)

    # Headroom buys latency under fluctuation; flex traffic asked for none, so its plan
    # carries the demand itself, and scales in within the HPA's 10 % tolerance of it.
    out_margin = 0.0 if throughput_only else ps.headroom
    in_margin = ps.flex_scale_in_headroom if throughput_only else ps.scale_in_headroom
    need = next((r for r in range(lo, hi + 1) if carries(r, out_margin)), None)
    short = need is None  # even the most replicas cannot carry it within the objective
    need = hi if need is None else need
    if need < cur.replicas and not (carries(need, in_margin)
                                    and (throughput_only or _p95_after(s, cur, need, model) <= goal_p95)):
        need = cur.replicas  # fewer would carry it, but without the scale-in margin: stay
    x = width(need)
    seqs = bounds.max_num_seqs.clamp(max(1, math.floor(x)) if math.isfinite(x) else bounds.max_num_seqs.max)
    if short:
        # Out of replicas: a narrower batch would trade the queue (TTFT) for TPOT and lose
        # both; serve as wide as the KV cache holds without preempting (the most tokens/s).
        widest = bounds.max_num_seqs.clamp(int(kv_cap)) if math.isfinite(kv_cap) else cur.max_num_seqs
        seqs = max(seqs, cur.max_num_seqs, widest)
    if abs(seqs - cur.max_num_seqs) <= ps.seq_dead_band * cur.max_num_seqs:
        seqs = cur.max_num_seqs
    carried = need * x / step_s(need) if math.isfinite(x) else math.inf
    why = (f"{model}; demand {arrivals:.1f} req/s arriving + {waiting_now:.0f} queued over {drain_s:.0f}s = "
           f"{demand:.0f} output and {prompt:.0f} prompt tok/s: ")
    if throughput_only:
        why += (f"only service_tier flex requests finished ({s.flex_share:.0%}), so no TPOT objective holds; "
                f"{need} replica(s) at <= {x:.0f} running each (TPOT ~{1000 * step_s(need):.0f}ms) "
                f"carry {carried:.0f} tok/s")
    else:
        why += (f"{need} replica(s) at <= {x:.0f} running each keep mean TPOT <= {1000 * goal:.0f}ms "
                f"and carry {carried:.0f} tok/s")
    if short:
        why += f"; short of capacity even at {hi} replicas, so the batch is not narrowed"
    if kv_cap < math.inf and x >= kv_cap - 1e-9:
        why += f" (the KV cache holds ~{kv_cap:.0f} sequences of the mean length)"
    err = model.uncertainty(x if math.isfinite(x) else 1.0, prompt / need)
    why += f"; uncertainty there +/-{100 * err:.0f}%" if math.isfinite(err) else "; uncertainty there unknown"
    return Plan(need, seqs, why, err)
