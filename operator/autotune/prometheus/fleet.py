"""Reads every LLMDeployment behind one Prometheus with one set of queries.

The per-deployment reader (prometheus.py) asks about fifty instant queries for each
deployment; for a fleet of N that is 50 x N queries per resync. The FleetReader asks
the same PromQL once, grouped `by (namespace, <deployment label>)`, keeps the answers
for the resync pass that asked, and cuts each deployment's MetricsSnapshot out of them with
the very same assembly (prometheus.assemble_snapshot), so both readers give the same
MetricsSnapshot for the same data.

A FleetReaders object lives for one resync pass: it hands each Prometheus URL its own
FleetReader (deployments pointing at different Prometheus servers are read apart), and
is then dropped, so the next pass reads fresh data. Concurrent reconciles share it: the
first one that needs a window's answers queries while the others wait for them. A failed
read is kept too, so a Prometheus that is down costs one failed set of queries per pass,
not one per deployment. The set's queries go out `parallel` at a time: the reconciles that
wait for them count that wait in their latency."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from .queries import (DEFAULT_REFUSAL_METRIC, FleetTarget, Target, build_freshness_queries, build_queries,
                     build_settings_queries, duration)
from .reader import Answers, assemble_snapshot, read_idle
from .client import QueryClient, checked_query, instant_samples
from ..signals import MetricsSnapshot

Key = tuple[str, str]  # (namespace, deployment)


@dataclass
class FleetAnswers:
    """Every deployment's answers to one window's queries, indexed by (namespace, name)."""

    values: dict[str, dict[Key, tuple[float, float | None]]] = field(default_factory=dict)
    newest: dict[str, dict[Key, tuple[float, float | None]]] = field(default_factory=dict)
    settings: dict[str, dict[Key, list[dict]]] = field(default_factory=dict)

    def cut(self, namespace: str, name: str) -> Answers:
        key = (namespace, name)
        return Answers(values={f: by.get(key) for f, by in self.values.items()},
                       newest={m: by.get(key) for m, by in self.newest.items()},
                       settings={s: by.get(key, []) for s, by in self.settings.items()})


class FleetReader:
    """snapshot(namespace, name, window_s) like PrometheusReader's, from answers shared by
    every deployment (asked once per window and evaluation time)."""

    def __init__(self, client: QueryClient, *, scrape_interval_s: float = 15.0, stale_after_scrapes: float = 3.0,
                 label: str = "llmdeployment", namespace_label: str = "namespace", pod_label: str = "pod",
                 refusal_metric: str = DEFAULT_REFUSAL_METRIC, parallel: int = 8) -> None:
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel!r}")
        self.client = client
        self.url = str(getattr(client, "url", "") or "?")
        self.parallel = parallel
        self.stale_after_s = scrape_interval_s * stale_after_scrapes
        self.target = FleetTarget(label, namespace_label, pod_label)
        self.refusal_metric = refusal_metric
        self._guard = threading.Lock()
        self._pending: dict[tuple, threading.Lock] = {}
        self._answers: dict[tuple, FleetAnswers | Exception] = {}

    def idle(self, namespace: str, name: str, period_s: float):
        """One deployment's IdleReport (asked only of quiet deployments with minReplicas 0)."""
        target = Target(namespace, name, self.target.label, self.target.namespace_label, self.target.pod_label)
        return read_idle(self.client, self.url, target, period_s)

    def snapshot(self, namespace: str, name: str, window_s: float, at: float | None = None) -> MetricsSnapshot:
        answers = self.fleet_answers(window_s, at)
        return assemble_snapshot(answers.cut(namespace, name), window_s, at, stale_after_s=self.stale_after_s,
                                 refusal_metric=self.refusal_metric, pod_label=self.target.pod_label)

    def fleet_answers(self, window_s: float, at: float | None = None) -> FleetAnswers:
        """The window's answers, queried by the first caller; the rest wait for them."""
        key = (duration(window_s), at)
        with self._guard:
            lock = self._pending.setdefault(key, threading.Lock())
        with lock:
            if key not in self._answers:
                try:
                    self._answers[key] = self._query(window_s, at)
                except Exception as e:  # kept: every deployment of this pass sees the same failure
                    self._answers[key] = e
        got = self._answers[key]
        if isinstance(got, Exception):
            raise got
        return got

    def _query(self, window_s: float, at: float | None) -> FleetAnswers:
        params = {"time": f"{at:.3f}"} if at is not None else None

        def query(q: str) -> list[dict]:  # MetricsUnavailable, as the per-deployment reader's
            return checked_query(self.client, self.url, q, params)

        def key_of(labels: dict) -> Key:
            return labels.get(self.target.namespace_label, ""), labels.get(self.target.label, "")

        def by_key(result: list[dict]) -> dict[Key, tuple[float, float | None]]:
            return {key_of(labels): (ts, value) for labels, ts, value in instant_samples(result)}

        values = build_queries(self.target, window_s, self.refusal_metric)
        newest = build_freshness_queries(self.target, self.refusal_metric)
        settings = build_settings_queries(self.target)
        texts = [*values.values(), *newest.values(), *settings.values()]
        first = query(texts[0])  # alone: a Prometheus that is down fails once, not `parallel` times
        with ThreadPoolExecutor(max_workers=self.parallel, thread_name_prefix="kvpilot-fleet-read") as pool:
            results = iter([first, *pool.map(query, texts[1:])])  # the first failure propagates
        out = FleetAnswers()
        for f in values:
            out.values[f] = by_key(next(results))
        for m in newest:
            out.newest[m] = by_key(next(results))
        for setting in settings:
            grouped: dict[Key, list[dict]] = {}
            for series in next(results):
                grouped.setdefault(key_of(series.get("metric") or {}), []).append(series)
            out.settings[setting] = grouped
        return out


class FleetReaders:
    """One FleetReader per Prometheus URL, for one resync pass (`reader_for` is the
    autotune hook's reader factory)."""

    def __init__(self, make_reader: Callable[[str], Any]) -> None:
        self._make = make_reader
        self._guard = threading.Lock()
        self._readers: dict[str, Any] = {}

    def reader_for(self, url: str):
        with self._guard:
            if url not in self._readers:
                self._readers[url] = self._make(url)
            return self._readers[url]

    @property
    def urls(self) -> list[str]:
        with self._guard:
            return sorted(self._readers)
