"""A small PromQL evaluator over in-memory samples: exactly the query shapes the
autotuner's reader builds (prometheus.py), with Prometheus's own semantics, so that
the policy can read a simulated fleet in virtual time through the very same reader.

Supported: selectors `name{label="value",label!="value",...}` with an optional range `[Ns]`;
rate, avg_over_time, max_over_time, min_over_time, timestamp; sum, avg, min, max (with
`by (labels)`); histogram_quantile; binary + - * / between single-sample vectors or
scalars. rate() extrapolates as Prometheus does (extrapolatedRate); histogram_quantile
interpolates linearly inside the bucket, as Prometheus does. Instant selectors look
back 5 minutes for the newest sample, as Prometheus does, unless the series went stale
(its pod stopped being scraped) before the evaluation time."""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass, field

LOOKBACK_S = 300.0
MAX_PARSED = 1024  # distinct query texts kept parsed (a bound; the reader asks far fewer)
_TOKEN = re.compile(r"\s*(?:(?P<num>\d+(?:\.\d+)?(?:e[+-]?\d+)?)|(?P<dur>\[\d+(?:ms|s|m|h)\])|"
                    r"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)|(?P<str>\"(?:[^\"\\]|\\.)*\")|(?P<op>!=|[(){},=+\-*/]))")
_UNIT = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass
class Series:
    labels: dict[str, str]  # __name__ included
    times: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    # When the target stopped being scraped (a pod gone): Prometheus writes a staleness
    # marker then, and from it on an instant selector no longer returns the series.
    stale_at: float | None = None

    def add(self, t: float, v: float) -> None:
        if self.times and t <= self.times[-1]:
            raise ValueError("samples must be added in time order")
        self.times.append(t)
        self.values.append(v)

    def live_at(self, t: float) -> bool:
        return self.stale_at is None or t < self.stale_at

    def window(self, start: float, end: float) -> tuple[list[float], list[float]]:
        """Samples with start < t <= end (Prometheus's left-open range)."""
        lo = bisect.bisect_right(self.times, start)
        hi = bisect.bisect_right(self.times, end)
        return self.times[lo:hi], self.values[lo:hi]


class TSDB:
    """Series by (name, sorted labels); queried at an evaluation time."""

    def __init__(self) -> None:
        self.series: dict[tuple, Series] = {}
        self._by_name: dict[str, list[Series]] = {}
        # Parsed queries: the autotuner asks the same few dozen every interval.
        self._parsed: dict[str, object] = {}

    def add(self, name: str, labels: dict[str, str], t: float, value: float) -> None:
        key = (name, tuple(sorted(labels.items())))
        s = self.series.get(key)
        if s is None:
            s = self.series[key] = Series({"__name__": name, **labels})
            self._by_name.setdefault(name, []).append(s)
        s.add(t, value)

    def mark_stale(self, matchers: dict[str, str], t: float) -> None:
        """Every series carrying these labels goes stale at t (its target disappeared)."""
        for s in self.series.values():
            if s.stale_at is None and all(s.labels.get(k) == v for k, v in matchers.items()):
                s.stale_at = t

    def select(self, name: str, matchers: dict[str, str]) -> list[Series]:
        return [s for s in self._by_name.get(name, ()) if all(s.labels.get(k) == v for k, v in matchers.items())]

    def query(self, text: str, at: float) -> list[dict]:
        """Prometheus's /api/v1/query result (the `result` list) for an instant query."""
        expr = self._parsed.get(text)
        if expr is None:
            if len(self._parsed) >= MAX_PARSED:
                self._parsed.clear()
            expr = self._parsed[text] = _Parser(text).parse()
        value = expr.eval(self, at)
        if isinstance(value, float):
            return [{"metric": {}, "value": [at, _fmt(value)]}]
        return [{"metric": {k: v for k, v in labels.items() if k != "__name__"}, "value": [at, _fmt(v)]}
                for labels, v in value]


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


# --- Prometheus's functions --------------------------------------------------------------

def extrapolated_rate(times: list[float], values: list[float], start: float, end: float) -> float | None:
    """rate() of a counter over (start, end], as Prometheus computes it."""
    if len(times) < 2:
        return None
    result = values[-1] - values[0]
    for prev, cur in zip(values, values[1:]):
        if cur < prev:  # a counter reset
            result += prev
    sampled = times[-1] - times[0]
    to_start, to_end = times[0] - start, end - times[-1]
    average = sampled / (len(times) - 1)
    threshold = average * 1.1
    if result > 0 and values[0] >= 0:
        to_zero = sampled * (values[0] / result)
        to_start = min(to_start, to_zero)
    if to_start >= threshold:
        to_start = average / 2
    if to_end >= threshold:
        to_end = average / 2
    factor = (sampled + to_start + to_end) / sampled
    return result * factor / (end - start)


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """The q-quantile of (upper bound, cumulative count) buckets, Prometheus's way."""
    if not buckets or math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    buckets = sorted(buckets)
    if not math.isinf(buckets[-1][0]):
        return math.nan
    counts = [c for _, c in buckets]
    for i in range(1, len(counts)):  # monotonic, as Prometheus enforces
        counts[i] = max(counts[i], counts[i - 1])
    total = counts[-1]
    if total == 0 or len(buckets) < 2:
        return math.nan
    rank = q * total
    b = bisect.bisect_left(counts, rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    if b == 0 and buckets[0][0] <= 0:
        return buckets[0][0]
    start = 0.0 if b == 0 else buckets[b - 1][0]
    end = buckets[b][0]
    below = 0.0 if b == 0 else counts[b - 1]
    in_bucket = counts[b] - below
    return start + (end - start) * ((rank - below) / in_bucket) if in_bucket else end


# --- the syntax tree ---------------------------------------------------------------------

Vector = list[tuple[dict[str, str], float]]


@dataclass
class Selector:
    name: str
    matchers: dict[str, str]
    range_s: float | None = None
    excluded: tuple[tuple[str, str], ...] = ()  # (label, value) for label != value; absent reads as ""

    def series(self, db: TSDB) -> list[Series]:
        return [s for s in db.select(self.name, self.matchers)
                if all(s.labels.get(k, "") != v for k, v in self.excluded)]

    def eval(self, db: TSDB, at: float) -> Vector:
        if self.range_s is not None:
            raise ValueError(f"range selector {self.name}[...] needs a function")
        out = []
        for s in self.series(db):
            ts, vs = s.window(at - LOOKBACK_S, at)
            if ts and s.live_at(at):
                out.append((s.labels, vs[-1]))
        return out


@dataclass
class Call:
    func: str
    args: list

    def eval(self, db: TSDB, at: float) -> Vector | float:
        f = self.func
        if f == "histogram_quantile":
            q = self.args[0].eval(db, at)
            groups: dict[tuple, list[tuple[float, float]]] = {}
            for labels, v in self.args[1].eval(db, at):
                le = labels.get("le")
                if le is None:
                    continue
                rest = tuple(sorted((k, x) for k, x in labels.items() if k not in ("le", "__name__")))
                groups.setdefault(rest, []).append((float(le.replace("+Inf", "inf")), v))
            return [(dict(k), histogram_quantile(q, b)) for k, b in groups.items()]
        if f == "timestamp":
            inner = self.args[0]
            out = []
            for s in inner.series(db):
                ts, _ = s.window(at - LOOKBACK_S, at)
                if ts and s.live_at(at):
                    out.append((_drop_name(s.labels), ts[-1]))
            return out
        sel = self.args[0]
        if not isinstance(sel, Selector) or sel.range_s is None:
            raise ValueError(f"{f}() takes a range selector")
        start, out = at - sel.range_s, []
        for s in sel.series(db):
            ts, vs = s.window(start, at)
            if f == "rate":
                v = extrapolated_rate(ts, vs, start, at)
            elif not vs:
                v = None
            elif f == "avg_over_time":
                v = sum(vs) / len(vs)
            elif f == "max_over_time":
                v = max(vs)
            elif f == "min_over_time":
                v = min(vs)
            else:
                raise ValueError(f"unsupported function {f}")
            if v is not None:
                out.append((_drop_name(s.labels), v))
        return out


@dataclass
class Aggregate:
    op: str
    by: tuple[str, ...]
    expr: object

    def eval(self, db: TSDB, at: float) -> Vector:
        groups: dict[tuple, list[float]] = {}
        for labels, v in self.expr.eval(db, at):
            groups.setdefault(tuple((k, labels.get(k, "")) for k in self.by), []).append(v)
        fn = {"sum": sum, "min": min, "max": max, "avg": lambda xs: sum(xs) / len(xs)}[self.op]
        return [({k: v for k, v in key if v != ""}, fn(vals)) for key, vals in groups.items()]


@dataclass
class Number:
    value: float

    def eval(self, db: TSDB, at: float) -> float:
        return self.value


@dataclass
class Binary:
    op: str
    left: object
    right: object

    def eval(self, db: TSDB, at: float) -> Vector | float:
        a, b = self.left.eval(db, at), self.right.eval(db, at)
        if isinstance(a, float) and isinstance(b, float):
            return _apply(self.op, a, b)
        a_vec = a if isinstance(a, list) else None
        b_vec = b if isinstance(b, list) else None
        if a_vec is not None and b_vec is not None:  # one-to-one on identical label sets
            right = {tuple(sorted(lb.items())): v for lb, v in b_vec}
            return [(lb, _apply(self.op, v, right[key])) for lb, v in a_vec
                    if (key := tuple(sorted(lb.items()))) in right]
        if a_vec is not None:
            return [(lb, _apply(self.op, v, b)) for lb, v in a_vec]
        return [(lb, _apply(self.op, a, v)) for lb, v in b_vec]


def _apply(op: str, a: float, b: float) -> float:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if b == 0:
        return math.nan if a == 0 or math.isnan(a) else math.copysign(math.inf, a)
    return a / b


def _drop_name(labels: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in labels.items() if k != "__name__"}


# --- the parser --------------------------------------------------------------------------

class _Parser:
    _AGGREGATES = ("sum", "avg", "min", "max")
    _FUNCTIONS = ("rate", "avg_over_time", "max_over_time", "min_over_time", "timestamp", "histogram_quantile")

    def __init__(self, text: str) -> None:
        self.tokens, pos = [], 0
        text = text.strip()
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if not m or m.end() == pos:
                raise ValueError(f"promql: cannot read {text[pos:pos + 20]!r}")
            kind = m.lastgroup
            self.tokens.append((kind, m.group(kind)))
            pos = m.end()
        self.i = 0

    def parse(self):
        expr = self._sum()
        if self.i != len(self.tokens):
            raise ValueError(f"promql: unexpected {self.tokens[self.i][1]!r}")
        return expr

    def _peek(self, value: str | None = None):
        if self.i >= len(self.tokens):
            return None
        tok = self.tokens[self.i]
        return tok if value is None or tok[1] == value else None

    def _take(self, value: str | None = None):
        tok = self._peek(value)
        if tok is None:
            raise ValueError(f"promql: expected {value or 'a token'} at token {self.i}")
        self.i += 1
        return tok

    def _level(self, ops: tuple[str, ...], operand):
        """A left-associative chain of `ops` between operands."""
        left = operand()
        while any(self._peek(op) for op in ops):
            op = self._take()[1]
            left = Binary(op, left, operand())
        return left

    def _sum(self):
        return self._level(("+", "-"), self._product)

    def _product(self):
        return self._level(("*", "/"), self._atom)

    def _atom(self):
        kind, value = self._take()
        if kind == "num":
            return Number(float(value))
        if value == "(":
            inner = self._sum()
            self._take(")")
            return inner
        if kind != "name":
            raise ValueError(f"promql: unexpected {value!r}")
        if value in self._AGGREGATES:
            by: tuple[str, ...] = ()
            if self._peek("by"):
                self._take("by")
                self._take("(")
                names = [self._take()[1]]
                while self._peek(","):
                    self._take(",")
                    names.append(self._take()[1])
                self._take(")")
                by = tuple(names)
            self._take("(")
            inner = self._sum()
            self._take(")")
            return Aggregate(value, by, inner)
        if value in self._FUNCTIONS and self._peek("("):
            self._take("(")
            args = [self._sum()]
            while self._peek(","):
                self._take(",")
                args.append(self._sum())
            self._take(")")
            return Call(value, args)
        matchers: dict[str, str] = {}
        excluded: list[tuple[str, str]] = []
        if self._peek("{"):
            self._take("{")
            while not self._peek("}"):
                label = self._take()[1]
                negated = self._peek("!=") is not None
                self._take("!=" if negated else "=")
                text = self._take()[1][1:-1].replace('\\"', '"').replace("\\\\", "\\")
                if negated:
                    excluded.append((label, text))
                else:
                    matchers[label] = text
                if self._peek(","):
                    self._take(",")
            self._take("}")
        range_s = None
        if self._peek() and self._peek()[0] == "dur":
            text = self._take()[1][1:-1]
            unit = next(u for u in ("ms", "s", "m", "h") if text.endswith(u))
            range_s = float(text[: -len(unit)]) * _UNIT[unit]
        return Selector(value, matchers, range_s, tuple(excluded))
