"""Streams carry deltas: what each choice gained, sliced once on the engine thread, merged
when the reader lags, grown into whole choices on the loop side."""
from __future__ import annotations

import asyncio

from kvpilot.engine.core.outputs import CompletionOutput, TokenLogprob
from kvpilot.engine.server.streams import RequestStream, RequestTrack, StreamUpdate
from kvpilot.engine.server.serving_common import DeltaTracker


def _lp(t: int) -> TokenLogprob:
    return TokenLogprob(t, -float(t), [])


def test_deltas_are_what_each_choice_gained_and_finish_once():
    track = RequestTrack(num_prompt_tokens=3, n=2, logprobs=True)
    a = CompletionOutput(0, "", [], logprobs=[])
    b = CompletionOutput(1, "", [], logprobs=[])
    a.text, a.token_ids, a.logprobs = "he", [5, 6], [_lp(5), _lp(6)]
    first = track.deltas([a, b])
    assert [(d.index, d.text, d.token_ids, len(d.logprobs)) for d in first] == [(0, "he", [5, 6], 2)]
    a.text, a.token_ids, a.logprobs = "hello", [5, 6, 7], [_lp(5), _lp(6), _lp(7)]
    b.text, b.token_ids, b.logprobs, b.finish_reason = "x", [9], [_lp(9)], "length"
    second = track.deltas([a, b])
    assert [(d.index, d.text, d.token_ids, d.finish_reason) for d in second] == [
        (0, "llo", [7], None), (1, "x", [9], "length")]
    assert track.deltas([a, b]) == []  # nothing new; the finished choice is never sent again
    assert [(d.index, d.finish_reason, d.logprobs) for d in track.aborted()] == [(0, "abort", [])]


def test_a_lagging_reader_gets_the_queued_deltas_merged_and_the_whole_choices():
    async def main():
        stream = RequestStream("r", lambda stream: None, n=1)
        track = RequestTrack(1, 1, logprobs=False)
        out = CompletionOutput(0, "", [])
        for text, ids in (("a", [1]), ("ab", [1, 2]), ("abc", [1, 2, 3])):
            out.text, out.token_ids = text, ids
            stream._put(StreamUpdate("r", track.deltas([out]), False, 1))
        snap = await stream.get()
        assert [(d.text, d.token_ids) for d in snap.deltas] == [("abc", [1, 2, 3])]
        out.text, out.token_ids, out.finish_reason = "abcd", [1, 2, 3, 4], "stop"
        stream._put(StreamUpdate("r", track.deltas([out]), True, 1))
        snap = await stream.get()
        assert [(d.text, d.token_ids) for d in snap.deltas] == [("d", [4])]
        assert (snap.choices[0].text, snap.choices[0].token_ids) == ("abcd", [1, 2, 3, 4])
        assert snap.finished and stream.finished

    asyncio.run(main())


def test_tokens_whose_text_is_held_back_send_their_logprobs_with_the_next_chunk():
    track, tracker = RequestTrack(1, 1, logprobs=True), DeltaTracker(1)
    out = CompletionOutput(0, "", [], logprobs=[])
    out.token_ids, out.logprobs = [1], [_lp(1)]  # text held back (a possible stop string)
    assert tracker.take(track.deltas([out])[0]) is None
    out.text, out.token_ids, out.logprobs = "ok", [1, 2], [_lp(1), _lp(2)]
    text, logprobs = tracker.take(track.deltas([out])[0])
    assert text == "ok" and [lp.token_id for lp in logprobs] == [1, 2]
