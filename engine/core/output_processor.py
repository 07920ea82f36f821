"""Detokenizes sampled tokens, applies stop strings, and groups n>1 children into
one RequestOutput per user request."""

from __future__ import annotations

from .detokenizer import IncrementalDetokenizer
from .latency import GroupSummary
from .outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from .request import Request, RequestGroup, RequestStatus
from .tokenizer import Tokenizer


class OutputProcessor:
    """Builds each choice's CompletionOutput on its Request (`req.out`: its
    `completion` and `detokenizer`) and reports user requests (`RequestGroup`s) as RequestOutputs."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._groups: dict[str, RequestGroup] = {}  # unfinished user requests, by their id

    def has(self, request_id: str) -> bool:
        return request_id in self._groups

    def group(self, request_id: str) -> RequestGroup | None:
        return self._groups.get(request_id)

    def add(self, group: RequestGroup) -> None:
        params = group.children[0].sampling_params
        for i, child in enumerate(group.children):
            child.out.group, child.out.index = group, i
            child.out.completion = CompletionOutput(
                index=i, text="", token_ids=[],
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None)
            if params.detokenize:
                child.out.detokenizer = IncrementalDetokenizer(
                    self.tokenizer, group.prompt_token_ids, params.skip_special_tokens)
        self._groups[group.request_id] = group

    @staticmethod
    def group_summary(req: Request) -> GroupSummary | None:
        """The user request's n and longest output, once: for the last of its choices to
        finish (None for the others, and for choices finishing after it in one step)."""
        group = req.out.group
        if group is None or group.summary_recorded or not group.finished:
            return None
        group.summary_recorded = True
        return GroupSummary(n=len(group.children),
                            max_num_generation_tokens=max(len(c.output_token_ids) for c in group.children))

    def drop(self, group: RequestGroup) -> None:
        self._groups.pop(group.request_id, None)

    @staticmethod
    def first_token_of_group(req: Request) -> bool:
        """True once per user request: when any of its n choices gets its first token."""
        group = req.out.group
        seen, group.first_token_seen = group.first_token_seen, True
        return not seen

    def on_new_tokens(self, req: Request, num_new: int,
                      logprobs: list[TokenLogprob] | None) -> tuple[str | None, int]:
        """Record the request's `num_new` newest tokens in order (one, or with speculation
        several); at a stop string, stop there (the scheduler drops the request's tokens
        after it). Returns the stop string (or None) and the tokens kept."""
        if num_new == 1 and logprobs is None and req.out.detokenizer is None:
            # What on_token does for a token with no text and no logprobs to record (per
            # sequence per step in the simulator: kept lean).
            req.out.completion.token_ids.append(req.output_token_ids[-1])
            return None, 1
        first = len(req.output_token_ids) - num_new
        for j in range(num_new):
            stop = self.on_token(req, req.output_token_ids[first + j],
                                 logprobs[j] if logprobs is not None else None, last=j == num_new - 1)
            if stop is not None:
                return stop, j + 1
        return None, num_new

    @staticmethod
    def on_decoded(req: Request, token_ids: list[int]) -> None:
        """A run of tokens with no text, logprobs or stop to look for (on_new_tokens' lean
        case, once for the run): the fleet's fast-forward."""
        req.out.completion.token_ids += token_ids

    @staticmethod
    def on_token(req: Request, token: int, logprob: TokenLogprob | None, last: bool = True) -> str | None:
        """Record one of the request's new tokens (in order; `last`: the newest, which a
        stop token ends); return the stop string it completed, if any."""
        out = req.out.completion
        out.token_ids.append(token)
        params = req.sampling_params
        if logprob is not None and out.logprobs is not None:
            logprob.top = logprob.top[: params.logprobs]
            out.logprobs.append(logprob)
            out.cumulative_logprob += logprob.logprob
        detok = req.out.detokenizer
        if detok is None:
            return None
        ended_by_stop_token = (last and req.status is RequestStatus.FINISHED_STOPPED
                               and token in req.stop_token_ids)
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

    @staticmethod
    def on_finished(req: Request) -> None:
        out = req.out.completion
        if out.finish_reason == "stop" and isinstance(out.stop_reason, str):
            return  # text already cut at the stop string
        detok = req.out.detokenizer
        if detok is None:
            out.finish_reason, out.stop_reason = req.status.value, req.stop_reason
            return
        detok.flush()
        out.text = detok.text
        out.finish_reason = req.status.value
        out.stop_reason = req.stop_reason

    def collect(self, progressed: list[Request]) -> list[RequestOutput]:
        results = []
        seen: set[RequestGroup] = set()
        for req in progressed:
            group = req.out.group
            if len(group.children) > 1:
                if group in seen:
                    continue  # one output per user request and step
                seen.add(group)
                finished = group.finished
            else:
                finished = req.status.finished
            if not finished and req.sampling_params.output_kind == "final_only":
                continue
            results.append(RequestOutput(
                request_id=group.request_id, prompt=group.prompt,
                prompt_token_ids=group.prompt_token_ids,
                outputs=[c.out.completion for c in group.children],
                finished=finished, metrics=_metrics(group.children),
            ))
            if finished:
                self.drop(group)
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
