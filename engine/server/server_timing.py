"""The W3C `Server-Timing` header on non-streaming responses: the engine's own view of
one request's latency (queue, time to first token, time per output token, end to end),
in milliseconds. A client that does not stream cannot see TTFT or TPOT; with this header
a benchmark or a browser's devtools can, without the per-token cost of SSE."""

from __future__ import annotations

from ..core.outputs import RequestMetrics


def server_timing(m: RequestMetrics | None, num_output_tokens: list[int]) -> str | None:
    """`num_output_tokens` per choice. TPOT is vLLM's per-request mean, (last token - first
    token) / (tokens - 1), given only for a single choice with at least two tokens."""
    if m is None or m.first_token_time is None:
        return None
    parts = []
    if m.queue_time is not None:
        parts.append(("queue", m.queue_time))
    parts.append(("ttft", m.first_token_time - m.arrival_time))
    if len(num_output_tokens) == 1 and num_output_tokens[0] >= 2 and m.last_token_time is not None:
        parts.append(("tpot", (m.last_token_time - m.first_token_time) / (num_output_tokens[0] - 1)))
    # the scheduler stamps `finished` inside the step that the last token's stamp follows
    ends = [t for t in (m.finished_time, m.last_token_time) if t is not None]
    parts.append(("e2e", max(ends) - m.arrival_time))
    return ", ".join(f"{name};dur={1000 * max(0.0, s):.3f}" for name, s in parts)


def parse_server_timing(header: str | None) -> dict[str, float]:
    """{"ttft": seconds, ...} from a `Server-Timing` header; entries without a duration
    (or not this server's) are skipped."""
    out: dict[str, float] = {}
    for part in (header or "").split(","):
        name, _, params = part.strip().partition(";")
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key == "dur":
                try:
                    out[name] = float(value) / 1000.0
                except ValueError:
                    pass
    return out
