"""Reads one LLMDeployment's signals from Prometheus into a MetricsSnapshot, with the queries of
promql.py (which says what each signal is read from) over a QueryClient (query_client.py).

Staleness: for each raw metric, the oldest pod's newest sample (`min(timestamp(...))`)
is compared with the query's evaluation time; older than `stale_after_scrapes` scrape
intervals means stale. A metric with no series at all is missing. rate() needs two
samples inside the window, so the window should span at least four scrape intervals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .queries import (DEFAULT_REFUSAL_METRIC, EXTRA_SOURCES, PREEMPTED_WAITING, SOURCES, TIERED_TPOT_P95, Target, build_freshness_queries,
                     build_idle_queries, build_queries, build_settings_queries)
from .client import QueryClient, checked_query, connect, first_sample, instant_samples
from ..signals import PodSettings, MetricsSnapshot




def read_idle(client: QueryClient, url: str, target: Target, period_s: float):
    from ..scale_to_zero import IdleReport

    values = {}
    for field, q in build_idle_queries(target, period_s).items():
        value = first_sample(checked_query(client, url, q))
        values[field] = value[1] if value is not None else None
    return IdleReport(**values)


class PrometheusReader:
    """MetricsSnapshot = reader.snapshot(namespace, name, window_s)."""

    def __init__(self, client: QueryClient, *, url: str = "", scrape_interval_s: float = 15.0, stale_after_scrapes: float = 3.0,
                 label: str = "llmdeployment", namespace_label: str = "namespace", pod_label: str = "pod",
                 refusal_metric: str = DEFAULT_REFUSAL_METRIC) -> None:
        self.client = client
        self.url = url or str(getattr(client, "url", "") or "?")
        self.stale_after_s = scrape_interval_s * stale_after_scrapes
        self.label, self.namespace_label, self.pod_label = label, namespace_label, pod_label
        self.refusal_metric = refusal_metric

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> PrometheusReader:

        return cls(connect(url, "deployment"), url=url, **kwargs)

    def target(self, namespace: str, name: str) -> Target:
        return Target(namespace, name, self.label, self.namespace_label, self.pod_label)

    def idle(self, namespace: str, name: str, period_s: float):
        """The IdleReport of the `period_s` seconds ending now."""
        return read_idle(self.client, self.url, self.target(namespace, name), period_s)

    def snapshot(self, namespace: str, name: str, window_s: float, at: float | None = None) -> MetricsSnapshot:
        """The deployment's signals over the `window_s` seconds ending at `at` (unix
        seconds; Prometheus's own now when None). Query errors propagate to the caller."""
        target = self.target(namespace, name)
        params = {"time": f"{at:.3f}"} if at is not None else None

        def query(q: str) -> list[dict]:
            return checked_query(self.client, self.url, q, params)

        answers = Answers(
            values={f: first_sample(query(q)) for f, q in build_queries(target, window_s, self.refusal_metric).items()},
            newest={m: first_sample(query(q)) for m, q in build_freshness_queries(target, self.refusal_metric).items()},
            settings={k: query(q) for k, q in build_settings_queries(target).items()})
        return assemble_snapshot(answers, window_s, at, stale_after_s=self.stale_after_s,
                                 refusal_metric=self.refusal_metric, pod_label=self.pod_label)


@dataclass
class Answers:
    """One deployment's query answers: (evaluation time, value) or None per MetricsSnapshot field
    and per raw metric's newest-sample query, and the settings gauges' series."""

    values: dict[str, tuple[float, float | None] | None]
    newest: dict[str, tuple[float, float | None] | None]
    settings: dict[str, list[dict]]


def assemble_snapshot(answers: Answers, window_s: float, at: float | None, *, stale_after_s: float,
                      refusal_metric: str = DEFAULT_REFUSAL_METRIC, pod_label: str = "pod") -> MetricsSnapshot:
    """The MetricsSnapshot from the answers, whichever reader asked (one deployment or the fleet)."""
    values: dict[str, float | None] = {}
    eval_times: list[float] = []
    for field, got in answers.values.items():
        if got is None:  # no series: missing (if its metric is absent) or empty rate
            values[field] = None
            continue
        eval_times.append(got[0])
        value = got[1]  # never a decision from a non-number: NaN and Inf read as no value
        values[field] = value if value is not None and math.isfinite(value) else None

    newest: dict[str, float | None] = {}
    for metric, got in answers.newest.items():
        newest[metric] = None if got is None else got[1]
        if got is not None:
            eval_times.append(got[0])
    now = at if at is not None else (max(eval_times) if eval_times else 0.0)

    sources = list(SOURCES.items()) + list(EXTRA_SOURCES.items())
    sources.append(("length_refusals_per_s", refusal_metric))
    missing, stale = [], []
    for field, metric in sources:
        if newest.get(metric) is None:
            missing.append(field)
        elif now - newest[metric] > stale_after_s:
            stale.append(field)
    for field in missing + stale:
        values[field] = None
    for field, extra in PREEMPTED_WAITING.items():
        preempted = values.pop(extra, None)  # None: stock vLLM (they are in its waiting gauge)
        if preempted is not None and values.get(field) is not None:
            values[field] += preempted
    tiered = values.pop(TIERED_TPOT_P95, None)
    if "flex_share" not in missing and "tpot_p95_s" not in missing + stale:
        values["tpot_p95_s"] = tiered  # None when only flex requests finished

    pods: dict[str, dict] = {}
    for setting, result in answers.settings.items():
        for labels, _, value in instant_samples(result):
            if value is not None:
                pods.setdefault(str(labels.get(pod_label, "?")), {})[setting] = int(value)

    return MetricsSnapshot(
        time=now, window_s=window_s,
        pods=tuple(PodSettings(pod, **s) for pod, s in sorted(pods.items())),
        missing=tuple(sorted(set(missing))), stale=tuple(sorted(set(stale))),
        **values,
    )
