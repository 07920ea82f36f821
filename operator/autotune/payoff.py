"""Does a scale-out pay for itself? Good requests per GPU-hour is what the autotuner is judged
by, and a replica can only raise it by bringing requests that now miss the objectives within
them.

With R replicas serving G good requests/s and M missing the objectives, k more replicas give
at most (G + M) / (R + k) good requests/s per replica against G / R now: they can pay only while
M / G > k / R, that is while the miss share m = M / (G + M) exceeds k / (R + k). So at one
replica a second pays only when more than half of the requests miss; at four, a fifth when
more than a fifth do. A scale-out is cut to the replicas that can pay, or held, unless the
user's `objectives.attainment` asks for them (its share of requests within the objectives is
bought with GPUs).

The miss share is read from what the pods export, not from the simulator's timing model:
- the share over each objective, from the TTFT and TPOT histograms' p50, p75, p90 and p95
  (linear between them, as histogram_quantile interpolates within a bucket; above p95 it
  counts as 5 %). A request missing both is counted twice, and the lower TPOT quantiles
  include flex requests (p95 leaves them out where the pods label tiers): the share is an
  upper bound, which errs toward adding the replica;
- requests aborted (a client that gave up), which record no first token;
- requests waiting now further back than the finish rate serves within the TTFT objective:
  they will miss it, and no histogram holds them yet.
No objective or an objective whose quantiles are not read: no guard (the rules add the
replica). Fewer than `payoff_min_requests` finished in the window: the share is judged at its
upper confidence bound (`share_upper_bound`), not left unguarded; at a quarter of Mooncake's
conversation rate no window ever held 50 requests, and every scale-out went through.

The window's share stands for the minutes to come only while the fleet keeps up with its
arrivals. When requests queue past half the TTFT objective, the queue is not draining, and
every slot stayed busy the whole window (the running count never fell below
`running_at_cap` x max_num_seqs per pod), arrivals outpace what the fleet serves: the queue and its wait
only lengthen, and soon every request misses. Such a scale-out is not cut (`outpaced`): on
the Azure conversation trace at four times its rate, one replica held for a window's 34 %
went on to serve 0-9 % of the next two minutes' requests within the objectives. A load that
climbs without a queue (the batch widens, TPOT crosses its objective for more requests each
interval) outruns the window the same way: a share that kept rising over the last few intervals,
by more than it moves by chance, is carried on at its pace over a replica's start-up before it
is judged (`rising_share`). The other way,
when fewer wait now than on average over the window, the fleet as it is already serves the
backlog the window's misses came from, and no replica is added for them (`draining`; replicas
the user's attainment asks for excepted): on Mooncake's conversation trace, a third replica
asked for in such a window stayed for the rest of the run, with about 13 % missing where two
had 18 %.

The share is an upper bound on what a replica brings: some misses no replica recovers (prompts
whose prefill alone takes longer than the objective, requests refused for length), and one
window's share is noisy. So a scale-out is checked once the windows its grown fleet served
whole hold payoff_min_requests (`unpaid_scale_out`, `pooled_good`; the rules add no further
replica until then: `fleet_unjudged`): good requests/s per replica against their mean over the intervals
before it at the smaller size (`record_good`, one point per interval, kept in the status). Clearly
fewer (by more than `payoff_verify_margin`) and the added replicas go back; adding them again
waits for `flip_backoff_s`, as a reverted setting does, unless arrivals outpace the fleet.
Replicas the user's attainment asks for are not checked: they are bought with GPUs. What the
returned replicas made good, as a share f of the requests that missed before them, replaces
the upper bound for `payoff_memory_s` (`learned_recovery`): k more pay only while
k < f m R / (1 - m). On Mooncake's conversation trace at half its rate (30-50 min), replicas
added for windows with 51 % and 65 % missing went back 135 s later, and no third was added
(f = 38 %): 2,970 -> 3,815 good requests per GPU-hour (SIMULATED)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .decision import Action, Settings, Thresholds
from .history import History
from .memory import blocked_move
from .signals import LOWER_QUANTILES, MetricsSnapshot

QUANTILES = (*LOWER_QUANTILES, 95)


def over_objective(s: MetricsSnapshot, kind: str, objective: float | None) -> float | None:
    """The share of finished requests whose `kind` ("ttft" or "tpot") exceeds `objective`,
    from the quantiles in the snapshot (None: no objective, or a quantile unread)."""
    if objective is None:
        return None
    points = [(0.0, 0.0)]  # (quantile, seconds), from a zero latency at q = 0
    for q in QUANTILES:
        v = getattr(s, f"{kind}_p{q}_s")
        if v is None:
            return None
        points.append((q / 100, max(v, points[-1][1])))  # monotone, whatever the rounding
    for (q0, v0), (q1, v1) in zip(points, points[1:]):
        if objective < v1:
            within = q0 + (q1 - q0) * (objective - v0) / (v1 - v0)
            return 1.0 - within
    return 1.0 - QUANTILES[-1] / 100


def miss_share(s: MetricsSnapshot, t: Thresholds) -> float | None:
    """The share of the window's requests that missed (or will miss) the objectives: an upper
    bound (module docstring); None where it cannot be read or too few requests finished."""
    read = share_read(s, t)
    return None if read is None or read[1] < t.payoff_min_requests else read[0]


def share_upper_bound(s: MetricsSnapshot, t: Thresholds) -> tuple[float, float, float] | None:
    """(the miss share's upper confidence bound, the share read, the requests it was read
    over) for a window with fewer than payoff_min_requests finished: too few to stand for the
    minutes to come, too many to ignore. Wilson's score bound `payoff_small_sample_z` standard
    errors up, which stays sound at a handful of requests (three without a miss still bound
    it at 57 %). None where nothing can be read."""
    read = share_read(s, t)
    if read is None:
        return None
    m, n = read
    z2 = t.payoff_small_sample_z ** 2
    centre = m + z2 / (2 * n)
    spread = t.payoff_small_sample_z * math.sqrt(m * (1 - m) / n + z2 / (4 * n * n))
    return min(1.0, (centre + spread) / (1 + z2 / n)), m, n


def share_read(s: MetricsSnapshot, t: Thresholds) -> tuple[float, float] | None:
    """(the miss share, the requests it is over) for the window whatever their number; None
    where it cannot be read or nothing finished."""
    finished = (s.request_rate_per_s or 0.0) * s.window_s
    if finished <= 0:
        return None
    ttft = over_objective(s, "ttft", t.ttft_objective_s)
    tpot = over_objective(s, "tpot", t.tpot_objective_s)
    if (ttft is None) != (t.ttft_objective_s is None) or (tpot is None) != (t.tpot_objective_s is None):
        return None  # an objective without its quantiles: the share would count too few
    if ttft is None and tpot is None:
        return None
    aborted = min(1.0, (s.aborted_per_s or 0.0) / s.request_rate_per_s)
    missed = min(1.0, (ttft or 0.0) + (tpot or 0.0) + aborted) * finished
    late = 0.0
    if t.ttft_objective_s is not None and s.num_waiting_now is not None:
        late = max(0.0, s.num_waiting_now - s.request_rate_per_s * t.ttft_objective_s)
    return (missed + late) / (finished + late), finished + late


def outpaced(s: MetricsSnapshot, cur: Settings, t: Thresholds) -> str | None:
    """Why the window's miss share understates the misses to come (None when it need not): every
    slot max_num_seqs allows stayed busy all window. The caller has seen the queue grow past the
    TTFT level."""
    slots = cur.max_num_seqs * max(s.serving(cur.replicas), 1)
    if s.running_min is None or s.running_min < t.running_at_cap * slots:
        return None
    return (f"all {slots} slots (max_num_seqs={cur.max_num_seqs}) stayed busy all window (running never "
            f"below {s.running_min:.0f}) while the queue grows: arrivals outpace the fleet, so more requests "
            f"will miss than the window shows")


def replicas_that_pay(s: MetricsSnapshot, t: Thresholds, old: int, new: int,
                      recovery: float = 1.0, share: float | None = None) -> tuple[int, str | None]:
    """(replicas to go to, why fewer than `new`) for a scale-out old -> new: `new` (and None)
    when the added replicas can pay, or the user's attainment asks for them, or the miss
    share cannot be read; otherwise the most that can pay (old: none). `recovery`: the share
    of the misses added replicas make good (1: all of them, the upper bound; less once a
    scale-out was seen to recover less, `learned_recovery`); `share`: the miss share to judge by
    in place of the window's (`rising_share`)."""
    m = miss_share(s, t) if share is None else share
    few = share_upper_bound(s, t) if m is None else None
    if few is not None:  # judged at the most the share can be, not left unguarded
        m = few[0]
    if m is None or m >= 1.0 or (t.attainment is not None and m > 1.0 - t.attainment):
        return new, None
    bound = recovery * m * old / (1.0 - m)  # k more pay only while k < f m R / (1 - m)
    k = max(0, min(new - old, math.ceil(bound) - 1))
    if old + k >= new:
        return new, None
    asked = (f" and the {t.attainment:.0%} attainment asked for is met" if t.attainment is not None else "")
    line = (new - old) / (new - old + recovery * old) if recovery > 0 else 1.0
    learnt = (f" (the last replicas added made good {recovery:.0%} of the requests that missed before them)"
              if recovery < 1.0 else "")
    whose = "of the requests" if share is not None else "of the window's requests"
    hedge = "about"
    if few is not None:
        hedge = "at most"
        whose = (f"of the window's requests ({few[1]:.0%} of {few[2]:.0f} read: too few to stand alone, so "
                 f"judged {t.payoff_small_sample_z:g} standard errors up)")
    return old + k, (f"{hedge} {m:.0%} {whose} miss the objectives{asked}: with {old} "
                     f"replica(s), {new - old} more can raise good requests per GPU-hour only if more "
                     f"than {line:.0%} miss{learnt}, so {'none' if k == 0 else k} added")


def good_per_replica(s: MetricsSnapshot, t: Thresholds, replicas: int) -> float | None:
    """Requests/s that met the objectives, per replica, by the window's miss share (None: unread)."""
    m = miss_share(s, t)
    return None if m is None or replicas < 1 else s.request_rate_per_s * (1.0 - m) / replicas


def record_good(history: History, s: MetricsSnapshot, replicas: int, t: Thresholds) -> History:
    """The history with this interval's good and finished requests/s per replica, by the
    window's miss share as read however few requests it holds (where it can be read at all):
    a check pools thin windows until they hold enough (`pooled_good`)."""
    if s.no_data_reason() or (read := share_read(s, t)) is None:
        return history
    serving = s.serving(replicas)
    finished = s.request_rate_per_s / serving
    return history.with_good(s.time, finished * (1.0 - read[0]), finished, replicas)


def pooled_good(rates: tuple[tuple[float, float, float, int], ...], window_s: float,
                t: Thresholds) -> tuple[float, float, float] | None:
    """(good, finished requests/s per replica, the requests read) over consecutive intervals'
    good_rates, oldest first, once they hold `payoff_min_requests` (None before). Windows
    overlap: after the first, each interval adds only the requests of the seconds since the
    one before. At a quarter of Mooncake's conversation rate a minute holds 25-65 requests;
    judged window by window, no scale-out there was ever checked, and pooled, the second and
    third replicas made 0.26 and 0.19 good requests/s each against 0.47 for one."""
    requests = _requests_read(rates, window_s)
    if requests < t.payoff_min_requests:
        return None
    return (sum(r[1] for r in rates) / len(rates), sum(r[2] for r in rates) / len(rates), requests)


def _requests_read(rates: tuple[tuple[float, float, float, int], ...], window_s: float) -> float:
    if not rates:
        return 0.0
    requests = rates[0][2] * rates[0][3] * window_s
    for (then, *_), (when, _, finished, replicas) in zip(rates, rates[1:]):
        requests += finished * replicas * min(when - then, window_s)
    return requests


def _awaiting_check(s: MetricsSnapshot, cur: Settings, history: History) -> tuple | None:
    """(the last scale-out's Decision, old, new, the good_rates of the windows its grown fleet
    served whole) while that scale-out is the one `unpaid_scale_out` judges: applied last, with
    a figure to be checked against, its replicas all serving; None otherwise."""
    last = history.last_applied()
    if last is None or last.decision.good_per_replica is None or "replicas" not in last.decision.change:
        return None
    d, grown = last.decision, history.grown
    old, new = d.change["replicas"]
    if (new <= old or cur.replicas != new or cur.hpa_owns_scale or grown is None or grown[0] < d.time
            or history.pods < new):
        return None
    return d, old, new, tuple(r for r in history.recent_good(new) if r[0] - s.window_s >= grown[0])


def fleet_unjudged(s: MetricsSnapshot, cur: Settings, history: History, t: Thresholds) -> str | None:
    """Why the fleet as it is has not been judged yet (None when it has): the newest replica
    has served less than a window, or the last scale-out's check is still pooling thin
    windows (`unpaid_scale_out`). Another replica waits: added before the judgement, it
    would be judged with the first, and a replica that did not pay would stay."""
    served = history.grown_within(s.time, s.window_s)
    if served is not None:  # most of this window is the smaller fleet's: it says nothing of the new one
        return f"the newest replica has served {served:.0f}s of the {s.window_s:.0f}s window"
    awaiting = _awaiting_check(s, cur, history)
    if awaiting is None:
        return None
    _, old, new, whole = awaiting
    read = _requests_read(whole, s.window_s)
    if not whole or read >= t.payoff_min_requests or len(whole) >= history.limit:  # judged, or never will be
        return None
    return (f"replicas {old} -> {new} are judged once the windows they served whole hold "
            f"{t.payoff_min_requests} requests ({read:.0f} so far)")


@dataclass(frozen=True)
class Payoff:
    """What judges a scale-out this interval (`payoff_of`)."""

    outpaced: str | None = None  # arrivals outpace the fleet: add what is asked, and say why
    draining: str | None = None  # the window's misses are a backlog being served: add nothing
    returned: str | None = None  # a scale-out that did not pay went back lately: not yet again
    # (good, finished) requests/s per replica over the recent intervals at this size
    before: tuple[float, float] | None = None
    recovery: float = 1.0  # the share of misses the last returned scale-out made good
    rising: tuple[float, str] | None = None  # (the miss share a start-up ahead, why): `rising_share`

    def judge(self, s: MetricsSnapshot, t: Thresholds, old: int, new: int) -> tuple[int, str, tuple | None]:
        """(replicas to go to, a note for the reason, the (good, finished) requests/s per replica
        the scale-out will be checked against, or None when it will not be) for old -> new."""
        if self.outpaced:
            return new, f": {self.outpaced}", None
        if self.returned or self.draining:
            return old, f", but {self.returned or self.draining}", None
        share = self.rising[0] if self.rising else None
        allowed, why = replicas_that_pay(s, t, old, new, self.recovery, share)
        # A climb is named whatever it allows: before the cut's reason, or as why all are added.
        climb = self.rising[1] if self.rising else None
        if why:
            note = f", but {climb}; {why}" if climb else f", but {why}"
        else:
            note = f": {climb}" if climb else ""
        before = self.before
        if before is None and (good := good_per_replica(s, t, old)) is not None:
            before = (good, s.request_rate_per_s / old)
        checked = allowed > old and t.attainment is None
        return allowed, note, before if checked else None


def payoff_of(s: MetricsSnapshot, cur: Settings, history: History, t: Thresholds, queueing: bool) -> Payoff:
    """This interval's Payoff; `queueing`: the queue grows past the TTFT level (an urgent scale-out)."""
    if queueing and (why := outpaced(s, cur, t)):
        return Payoff(outpaced=why)
    before = pooled_good(history.recent_good(cur.replicas), s.window_s, t)
    return Payoff(returned=blocked_move(history, "replicas", +1, s.time, t), draining=draining(s, t),
                  before=before[:2] if before else None, recovery=learned_recovery(history, s.time, t),
                  rising=rising_share(history, s, cur.replicas, t))


def rising_share(history: History, s: MetricsSnapshot, replicas: int, t: Thresholds) -> tuple[float, str] | None:
    """(the miss share a new replica's start-up ahead, why) when the share rose from interval
    to interval over the last `payoff_trend_points` intervals at this size, and from the first
    to the last by more than it moves by chance; None otherwise. A replica added now serves
    from `forecast_lead_s` on; while the share climbs, the window's own stands for less than
    the minutes that replica will serve (on the Azure conversation trace at three times its
    rate, one replica's share went 10 -> 17 -> 27 % in 30 s and nearly every request missed
    the two minutes after; a healthy window reads 10 %, 5 % above p95 of each objective), so
    the share is carried on at its pace over that lead."""
    n = t.payoff_trend_points
    if n < 2:
        return None
    pts = [(when, 1.0 - good / finished, finished * r * s.window_s)  # (time, share, requests)
           for when, good, finished, r in history.good_rates if r == replicas and finished > 0]
    trend, earlier = pts[-n:], [m for _, m, _ in pts[:-n]]
    if len(trend) < n or trend[-1][0] != s.time or trend[-1][0] <= trend[0][0]:
        return None
    shares = [m for _, m, _ in trend]
    if any(b <= a for a, b in zip(shares, shares[1:])):
        return None
    # By chance: the larger of a share's sampling error over the window's requests (the
    # trend's first and last windows taken as independent draws) and how far apart two of the
    # windows before it lie (misses come in clusters: one long prompt stretches every running
    # request's TPOT at once, so requests are not independent draws). Without enough of those
    # windows the noise is unknown, and the window's share stands.
    if len(earlier) < t.payoff_trend_min_history:
        return None
    sampling = math.sqrt(sum(m * (1.0 - m) / max(count, 1.0) for _, m, count in (trend[0], trend[-1])))
    mean = sum(earlier) / len(earlier)
    drift = math.sqrt(2.0 * sum((m - mean) ** 2 for m in earlier) / (len(earlier) - 1))
    rise, noise = shares[-1] - shares[0], max(sampling, drift)
    if rise <= t.payoff_trend_z * noise:
        return None
    ahead = min(1.0, shares[-1] + rise / (trend[-1][0] - trend[0][0]) * t.forecast_lead_s)
    chance = f"{rise / noise:.1f}x" if noise > 0 else "more than"
    return ahead, (f"the miss share rose {' -> '.join(f'{m:.0%}' for m in shares)} over the last "
                   f"{trend[-1][0] - trend[0][0]:.0f}s ({chance} what it moves by chance): "
                   f"at that pace about {ahead:.0%} miss by the time a replica added now serves "
                   f"({t.forecast_lead_s:.0f}s)")


def draining(s: MetricsSnapshot, t: Thresholds) -> str | None:
    """Why the window's miss share overstates the misses to come (None when it need not): fewer
    wait now than on average over the window, so the fleet as it is already serves the backlog
    its misses came from (the urgent scale-out reads a shrinking queue the same way). Replicas
    the user's attainment asks for are bought whatever the share."""
    now, mean = s.num_waiting_now, s.num_waiting or 0.0
    if (now is None or now >= mean or mean < t.waiting_enter or t.attainment is not None
            or miss_share(s, t) is None):
        return None
    return (f"the queue is draining ({mean:.1f} waiting on average, {now:.0f} now): the window's misses came "
            f"from a backlog the fleet as it is already serves, not from what it will go on missing")


def unpaid_scale_out(s: MetricsSnapshot, cur: Settings, history: History,
                     t: Thresholds) -> tuple[dict, str, tuple[float, float]] | None:
    """(replicas back, why, the (good, finished) requests/s per replica the grown fleet made) for
    the last scale-out, judged once, as soon as the windows its grown fleet served whole hold
    payoff_min_requests (the first such window, where traffic fills one: `pooled_good`), when
    those made clearly fewer good requests/s per replica than before it. The revert keeps
    those figures: learned_recovery reads them."""
    awaiting = _awaiting_check(s, cur, history)
    if awaiting is None:
        return None
    d, old, new, whole = awaiting
    if not whole or whole[-1][0] != s.time:  # not served whole yet, or this window unread
        return None
    pooled = pooled_good(whole, s.window_s, t)
    if pooled is None or _requests_read(whole[:-1], s.window_s) >= t.payoff_min_requests:  # too few, or judged
        return None
    good, finished, requests = pooled
    if good >= d.good_per_replica * (1.0 - t.payoff_verify_margin):
        return None
    span = s.time - whole[0][0] + s.window_s
    return {"replicas": (new, old)}, (
        f"replicas {old} -> {new} did not pay: {good:.2f} good requests/s per replica over the {span:.0f}s its "
        f"{new} served whole ({requests:.0f} requests, {finished:.2f}/s per replica finished, about "
        f"{1.0 - good / finished:.0%} missing the objectives) against {d.good_per_replica:.2f}/s before it; "
        f"giving {new - old} back"), (good, finished)


def learned_recovery(history: History, now: float, t: Thresholds) -> float:
    """The share of the requests missing before the last returned scale-out that its replicas made
    good, while it is remembered (payoff_memory_s); 1 (the upper bound) without one."""
    changes = [e.decision for e in history.entries if e.applied and "replicas" in e.decision.change]
    for out, back in zip(reversed(changes[:-1]), reversed(changes)):
        if back.action is not Action.REVERT or back.good_per_replica is None:
            continue
        if now - back.time > t.payoff_memory_s or out.good_per_replica is None or out.finished_per_replica is None:
            return 1.0
        old, new = out.change["replicas"]
        missed = (out.finished_per_replica - out.good_per_replica) * old
        if missed <= 0:
            return 1.0
        gained = back.good_per_replica * new - out.good_per_replica * old
        return min(1.0, max(0.0, gained / missed))
    return 1.0
