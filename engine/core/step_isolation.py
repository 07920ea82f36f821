"""Runs a step so that a failure caused by one request fails that request alone.

A step batches every scheduled request into one set of tensors, so an exception while
preparing, running or sampling any row fails the whole call. When it does, the step is run
again split in two halves, recursively, until the rows that fail alone are found; every
other row gets its token as usual. Re-running rows is safe: a KV slot is written with the
same values, block-table rows and penalty counts only add what is missing. A fault that is
not one request's (a lost device) fails every row, at the cost of 2B-1 runs for B rows."""

from __future__ import annotations

import logging
from typing import Callable

from .executor import EngineDeadError, StepResult
from .request import Request
from .scheduler import SchedulerOutput

log = logging.getLogger("kvpilot.engine")


def run_isolating(run: Callable[[SchedulerOutput], StepResult],
                  out: SchedulerOutput) -> tuple[StepResult, dict[Request, Exception]]:
    """The step's result for the rows that ran, and the exception of each row that failed."""
    try:
        return run(out), {}
    except EngineDeadError:
        raise  # no request's fault: re-running parts of the step cannot help
    except Exception as exc:
        if len(out.scheduled) == 1:
            log.exception("step failed for request %s alone", out.scheduled[0].request.request_id)
            return StepResult([], []), {out.scheduled[0].request: exc}
        log.warning("a step of %d requests failed (%s: %s); finding the request at fault",
                    len(out.scheduled), type(exc).__name__, exc)
    mid = len(out.scheduled) // 2
    results, failed = [], {}
    for part in (out.scheduled[:mid], out.scheduled[mid:]):
        sub = SchedulerOutput(started_at=out.started_at, follows_previous=out.follows_previous,
                              scheduled=part, freed=out.freed)
        result, part_failed = run_isolating(run, sub)
        results.append(result)
        failed.update(part_failed)
    return merge_results(results), failed


def merge_results(results: list[StepResult]) -> StepResult:
    requests = [r for res in results for r in res.requests]
    token_ids = [t for res in results for t in res.token_ids]
    if all(res.logprobs is None for res in results):
        return StepResult(requests, token_ids)
    logprobs = [lp for res in results
                for lp in (res.logprobs if res.logprobs is not None else [None] * len(res.requests))]
    return StepResult(requests, token_ids, logprobs)


def without(result: StepResult, dropped: set) -> StepResult:
    """The result less the rows of requests whose group is in `dropped`."""
    keep = [i for i, r in enumerate(result.requests) if r.out.group not in dropped]
    if len(keep) == len(result.requests):
        return result
    return StepResult([result.requests[i] for i in keep], [result.token_ids[i] for i in keep],
                      None if result.logprobs is None else [result.logprobs[i] for i in keep])
