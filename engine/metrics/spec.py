"""Speculative decoding's series, with vLLM's names (vllm:spec_decode_*), so vLLM's
speculative-decoding dashboard reads a kvpilot server; plus the live setting in effect.
Made only when the engine speculates, as vLLM does."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from .buckets import ENGINE_INDEX


class SpecDecodeMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, num_positions: int) -> None:
        labels, values = ["model_name", "engine"], (model_name, ENGINE_INDEX)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=registry).labels(*values)

        self.drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                          "Accepted tokens per draft position.", labels + ["position"], registry=registry)
        self.per_pos = [per_pos.labels(*values, str(p)) for p in range(num_positions)]
        self.num_speculative_tokens = Gauge(
            "kvpilot:num_speculative_tokens", "num_speculative_tokens in effect (live-tunable; 0 is off).",
            ["model_name"], registry=registry).labels(model_name)

    def record(self, stats, last, num_speculative_tokens: int | None) -> None:
        """`stats`, `last`: the engine's SpecDecodeStats now and at the previous call."""
        if num_speculative_tokens is not None:
            self.num_speculative_tokens.set(num_speculative_tokens)
        for counter, field in ((self.drafts, "num_drafts"), (self.draft_tokens, "num_draft_tokens"),
                               (self.accepted, "num_accepted_tokens")):
            delta = getattr(stats, field) - (getattr(last, field) if last is not None else 0)
            if delta > 0:
                counter.inc(delta)
        for pos, counter in enumerate(self.per_pos):
            delta = stats.accepted_per_pos[pos] - (last.accepted_per_pos[pos] if last is not None else 0)
            if delta > 0:
                counter.inc(delta)
