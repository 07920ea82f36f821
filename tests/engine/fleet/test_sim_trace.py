"""Request traces for the simulator: the JSONL format, its errors, and the generator."""

from __future__ import annotations

import json

import pytest

from kvpilot.engine.config.simulation import OutputLengths
from kvpilot.engine.fleet.trace import Phase, TraceRequest, generate, read_trace, write_trace


def test_a_trace_round_trips_and_sorts_by_arrival(tmp_path):
    reqs = [TraceRequest(2.0, 100, 10), TraceRequest(0.5, 50, 5, "sys", 20),
            TraceRequest(1.0, 3, 7, prompt_token_ids=(5, 6, 7), ignore_eos=False, service_tier="flex")]
    path = tmp_path / "t.jsonl"
    assert write_trace(path, reqs) == 3
    back = read_trace(path)
    assert [r.arrival for r in back] == [0.5, 1.0, 2.0]
    assert back[0] == reqs[1] and back[1] == reqs[2] and back[2] == reqs[0]


@pytest.mark.parametrize("line,message", [
    ('{"arrival": 1, "prompt_len": 5', "line 2: not valid JSON"),
    ('[1, 2]', "line 2: a trace line must be a JSON object"),
    ('{"prompt_len": 5, "output_len": 3}', "line 2: missing arrival"),
    ('{"arrival": -1, "prompt_len": 5, "output_len": 3}', "line 2: arrival must be a non-negative"),
    ('{"arrival": 1, "output_len": 3}', "line 2: missing prompt_len"),
    ('{"arrival": 1, "prompt_len": 0, "output_len": 3}', r"line 2: prompt_len must be an integer in \[1,"),
    ('{"arrival": 1, "prompt_len": 5, "output_len": "3"}', "line 2: output_len must be an integer"),
    ('{"arrival": 1, "prompt_len": 5, "output_len": 3, "prefix_len": 2}', "line 2: prefix_len needs a prefix_id"),
    ('{"arrival": 1, "prompt_len": 5, "output_len": 3, "prefix_id": "a", "prefix_len": 9}',
     r"line 2: prefix_len \(9\) exceeds the prompt's 5 tokens"),
    ('{"arrival": 1, "prompt_len": 5, "output_len": 3, "colour": "red"}', r"line 2: unknown field\(s\) \['colour'\]"),
    ('{"arrival": 1, "prompt_token_ids": [1, -2], "output_len": 3}', "line 2: prompt_token_ids must be"),
    ('{"arrival": 1, "prompt_len": 5, "output_len": 3, "service_tier": "auto"}',
     r"line 2: service_tier must be one of \['default', 'flex', 'priority'\]"),
])
def test_a_malformed_line_names_its_number_and_field(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arrival": 0, "prompt_len": 5, "output_len": 3}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        read_trace(path)


def test_missing_and_empty_traces(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        read_trace(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="holds no requests"):
        read_trace(tmp_path / "empty.jsonl")


def test_shared_prefixes_share_their_tokens_and_nothing_else():
    vocab = (4, 4096)
    a = TraceRequest(0, 300, 1, "sys", 200).token_ids(0, vocab)
    b = TraceRequest(0, 250, 1, "sys", 200).token_ids(1, vocab)
    c = TraceRequest(0, 300, 1, "other", 200).token_ids(2, vocab)
    assert a[:200] == b[:200] and a[200:250] != b[200:]
    assert a[:200] != c[:200]
    assert all(4 <= t < 4096 for t in a + b + c)
    assert TraceRequest(0, 300, 1).token_ids(0, vocab) == TraceRequest(9, 300, 5).token_ids(0, vocab)


def test_the_generator_is_seeded_and_follows_its_phases():
    phases = [Phase(duration=100, rate=5, input="fixed:100", output="uniform:10:20"),
              Phase(duration=50, rate=0), Phase(duration=100, rate=1, input="lognormal:4000:0.5",
                                                output="fixed:50", prefix_len=1000, prefix_groups=2)]
    one = list(generate(phases, seed=3, max_len=8192))
    assert one == list(generate(phases, seed=3, max_len=8192))
    assert one != list(generate(phases, seed=4, max_len=8192))
    first = [r for r in one if r.arrival < 100]
    last = [r for r in one if r.arrival >= 150]
    assert not [r for r in one if 100 <= r.arrival < 150]  # the quiet phase
    assert 400 < len(first) < 600 and 60 < len(last) < 140
    assert all(r.prompt_len == 100 and 10 <= r.output_len <= 20 for r in first)
    assert {r.prefix_id for r in last} == {"p2-0", "p2-1"} and all(r.prefix_len == 1000 for r in last)
    assert all(r.prompt_len + r.output_len <= 8192 for r in one)


def test_burstier_arrivals_have_more_variable_gaps():
    def cv(burstiness):
        t = [r.arrival for r in generate([Phase(duration=2000, rate=2, burstiness=burstiness)], seed=1)]
        gaps = [b - a for a, b in zip(t, t[1:])]
        mean = sum(gaps) / len(gaps)
        return (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean

    assert 0.9 < cv(1.0) < 1.1  # Poisson
    assert cv(0.25) > 1.6


def test_phase_and_length_specs_are_validated():
    assert Phase.parse("duration=60 rate=2 input=fixed:10 name=chat").name == "chat"
    batch = Phase.parse("duration=60 rate=2 service_tier=flex")
    assert {r.service_tier for r in generate([batch], seed=1)} == {"flex"}
    for text, message in [("rate=2", "needs duration="), ("duration=60 rate=2 speed=3", "KEY=VALUE"),
                          ("duration=x rate=2", "is not a float"), ("duration=60 rate=-1", "rate must be"),
                          ("duration=60 rate=1 input=gauss:3", "unknown distribution 'gauss'"),
                          ("duration=60 rate=1 prefix_fraction=2", "prefix_fraction"),
                          ("duration=60 rate=1 service_tier=cheap", "service_tier must be one of")]:
        with pytest.raises(ValueError, match=message):
            Phase.parse(text)
    assert OutputLengths.parse("uniform:5:9").sample(0.0) == 5
    assert OutputLengths.parse("uniform:5:9").sample(0.999) == 9
    assert OutputLengths.parse("lognormal:200:0.01").sample(0.5) == 200
    with pytest.raises(ValueError, match="uniform:LO:HI needs LO <= HI"):
        OutputLengths.parse("uniform:9:5")
    json.dumps(TraceRequest(0, 1, 1).to_json())


def test_a_repeated_scenario_is_its_days_back_to_back_with_the_day_as_its_season():
    from kvpilot.engine.fleet.scenarios import DAY, from_trace

    two = DAY.repeated(2)
    assert two.duration == 2 * DAY.duration and two.season_s == DAY.duration
    assert [p.name for p in two.phases][:2] == ["chat@1", "rag@1"] and two.phases[-1].name == "batch"
    assert len(two.slos) == 2 * len(DAY.slos) and DAY.repeated(1) is DAY
    assert two.scaled(0.5).season_s == DAY.duration / 2
    replay = from_trace("t", [TraceRequest(0.0, 10, 5), TraceRequest(9.0, 10, 5)]).repeated(3)
    assert [r.arrival for r in replay.trace()][:4] == pytest.approx([0.0, 9.0, 9.000001, 18.000001])
    with pytest.raises(ValueError, match="days"):
        DAY.repeated(0)
