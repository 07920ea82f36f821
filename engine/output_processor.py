"""Detokenizes sampled tokens, applies stop strings, and groups n>1 children into
one RequestOutput per user request."""

from __future__ import annotations

from dataclasses import dataclass

from .detokenizer import IncrementalDetokenizer
from .outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from .request import Request, RequestStatus
from .tokenizer import Tokenizer


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    completions: list[CompletionOutput]
    detokenizers: list[IncrementalDetokenizer]
    first_token_seen: bool = False


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._groups: dict[str, _Group] = {}
        self._child: dict[str, tuple[_Group, int]] = {}

    def has(self, request_id: str) -> bool:
        return request_id in self._groups

    def children(self, request_id: str) -> list[str]:
        group = self._groups.get(request_id)
        return [c.request_id for c in group.children] if group else []

    def add(self, request_id: str, prompt: str | None, prompt_ids: list[int], children: list[Request]) -> None:
        params = children[0].sampling_params
        group = _Group(
            request_id, prompt, prompt_ids, children,
            completions=[
                CompletionOutput(index=i, text="", token_ids=[],
                                 logprobs=[] if params.logprobs is not None else None,
                                 cumulative_logprob=0.0 if params.logprobs is not None else None)
                for i in range(len(children))
            ],
            detokenizers=[
                IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
                for _ in children
            ] if params.detokenize else [],
        )
        self._groups[request_id] = group
        for i, child in enumerate(children):
            self._child[child.request_id] = (group, i)

    def drop(self, request_id: str) -> None:
        group = self._groups.pop(request_id, None)
        for child in group.children if group else ():
            self._child.pop(child.request_id, None)

    def first_token_of_group(self, req: Request) -> bool:
        """True once per user request: when any of its n choices gets its first token."""
        group = self._child[req.request_id][0]
        seen, group.first_token_seen = group.first_token_seen, True
        return not seen

    def on_token(self, req: Request, logprob: TokenLogprob | None) -> str | None:
        """Record the request's newest token; return the stop string it completed, if any."""
        group, i = self._child[req.request_id]
        out = group.completions[i]
        token = req.output_token_ids[-1]
        out.token_ids.append(token)
        params = req.sampling_params
        if logprob is not None and out.logprobs is not None:
            logprob.top = logprob.top[: params.logprobs]
            out.logprobs.append(logprob)
            out.cumulative_logprob += logprob.logprob
        if not params.detokenize:
            return None
        ended_by_stop_token = req.status is RequestStatus.FINISHED_STOPPED and token in req.stop_token_ids
        detok = group.detokenizers[i]
        before = len(detok.text)
        if not ended_by_stop_token:
            detok.add([token])
        text = detok.text
        stops = params.stop_strings
        if not stops:
            out.text = text
            return None
        longest = max(len(s) for s in stops)
        window_start = max(0, before - longest + 1)
        for stop in stops:
            at = text.find(stop, window_start)
            if at >= 0:
                out.text = text[: at + (len(stop) if params.include_stop_str_in_output else 0)]
                out.finish_reason = "stop"
                out.stop_reason = stop
                return stop
        # Hold back a tail that could still grow into a stop string.
        out.text = text[: max(len(text) - (longest - 1), 0)]
        return None

    def on_finished(self, req: Request) -> None:
        group, i = self._child[req.request_id]
        out = group.completions[i]
        if out.finish_reason == "stop" and isinstance(out.stop_reason, str):
            return  # text already cut at the stop string
        if not req.sampling_params.detokenize:
            out.finish_reason, out.stop_reason = req.status.value, req.stop_reason
            return
        detok = group.detokenizers[i]
        detok.flush()
        out.text = detok.text
        out.finish_reason = req.status.value
        out.stop_reason = req.stop_reason

    def collect(self, progressed: list[Request]) -> list[RequestOutput]:
        results = []
        seen: set[str] = set()
        for req in progressed:
            entry = self._child.get(req.request_id)
            if entry is None:
                continue  # a sibling already finished the group in this loop
            group = entry[0]
            if len(group.children) > 1:
                if group.request_id in seen:
                    continue
                seen.add(group.request_id)
                finished = all(c.status.finished for c in group.children)
            else:
                finished = req.status.finished
            if not finished and req.sampling_params.output_kind == "final_only":
                continue
            results.append(RequestOutput(
                request_id=group.request_id, prompt=group.prompt,
                prompt_token_ids=group.prompt_token_ids, outputs=group.completions,
                finished=finished, metrics=_metrics(group.children),
            ))
            if finished:
                self.drop(group.request_id)
        return results


def _metrics(children: list[Request]) -> RequestMetrics:
    if len(children) == 1:
        c = children[0]
        t = c.times
        return RequestMetrics(t.arrival, t.first_scheduled, t.first_token, t.last_token, t.finished,
                              c.num_cached_tokens or 0, c.num_preemptions)

    def first(values):
        values = [v for v in values if v is not None]
        return min(values) if values else None

    def last(values):
        values = [v for v in values if v is not None]
        return max(values) if values else None

    times = [c.times for c in children]
    return RequestMetrics(
        arrival_time=times[0].arrival,
        first_scheduled_time=first(t.first_scheduled for t in times),
        first_token_time=first(t.first_token for t in times),
        last_token_time=last(t.last_token for t in times),
        finished_time=last(t.finished for t in times),
        num_cached_tokens=children[0].num_cached_tokens or 0,
        num_preemptions=sum(c.num_preemptions for c in children),
    )
