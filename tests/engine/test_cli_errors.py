"""The command line fails like a tool (issue 40, part 9): one line on stderr and a
non-zero exit, no traceback; a flag typo shows the subcommand's usage; `serve` checks
its model path and port before loading torch."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from kvpilot.engine.cli import main


def run_main(capsys, *argv) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "error:" in line]


def test_a_log_level_that_does_not_exist_is_refused(capsys):
    code, err = run_main(capsys, "--log-level", "verbose", "serve", "--model", "builtin:tiny")
    assert code == 2 and error_lines(err) == [err.strip()] and "invalid choice: 'VERBOSE'" in err


def _leaves(parser, prefix=()):
    """Every runnable subcommand's words, e.g. ("bench", "serve")."""
    import argparse

    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield prefix
        return
    for name, child in subs[0].choices.items():
        yield from _leaves(child, (*prefix, name))


def test_every_subcommand_refuses_a_wrong_value_in_one_line_and_shows_usage_only_for_a_typo(capsys):
    """`kvpilot serve --log-level verbose` (and the same after any subcommand) is one line
    naming the flag and its choices, no usage; an unknown flag prints that subcommand's
    usage, then one error line."""
    from kvpilot.engine.cli import LOG_LEVELS, build_parser

    leaves = list(_leaves(build_parser()))
    assert {("serve",), ("gateway",), ("operator",), ("bench", "serve"), ("sim", "run"), ("crd",)} <= set(leaves)
    assert any(words[0] == "autotune" for words in leaves)
    for words in leaves:
        code, err = run_main(capsys, *words, "--log-level", "verbose")
        prog = " ".join(("kvpilot", *words))
        assert code == 2 and err.strip().splitlines() == [
            f"{prog}: error: argument --log-level: invalid choice: 'VERBOSE' (choose from "
            + ", ".join(map(repr, LOG_LEVELS)) + ")"], (words, err)
        code, err = run_main(capsys, *words, "--definitely-not-a-flag")
        assert code == 2 and err.startswith(f"usage: {prog} "), (words, err)
        assert err.strip().splitlines()[-1].startswith(f"{prog}: error: "), (words, err)
        assert len(error_lines(err)) == 1


def test_wrong_values_of_typed_flags_are_one_line_naming_the_flag(capsys):
    for argv, expected in (
        (("serve", "--port", "x"), "kvpilot serve: error: argument --port: invalid int value: 'x'"),
        (("serve", "--dtype", "f8"), "kvpilot serve: error: argument --dtype: invalid choice: 'f8'"),
        (("sim", "run", "--scenario", "nope"), "kvpilot sim run: error: argument --scenario: invalid choice: 'nope'"),
        (("gateway", "--port", "-"), "kvpilot gateway: error: argument --port: invalid int value"),
        (("serve", "--log-level", "debug", "--max-queued-requests", "0", "--model", "builtin:tiny"),
         "kvpilot serve: error: max_queued_requests must be at least 1"),
    ):
        code, err = run_main(capsys, *argv)
        assert code == 2 and error_lines(err) == [err.strip()] and err.startswith(expected), (argv, err)


def test_a_flag_typo_shows_the_subcommands_usage(capsys):
    code, err = run_main(capsys, "serve", "--modle", "x")
    assert code == 2 and "kvpilot serve: error: unrecognized arguments: --modle x" in err
    assert "--max-queued-requests" in err  # the subcommand's own flags, not the top level's list
    code, err = run_main(capsys, "bench", "serve", "--base-url", "http://x", "--model", "m", "--nope")
    assert code == 2 and "kvpilot bench serve: error: unrecognized arguments: --nope" in err


def test_serve_names_the_missing_flag_and_checks_the_path(capsys, tmp_path):
    code, err = run_main(capsys, "serve")
    assert code == 2 and error_lines(err) == [err.strip()] and "--model is required" in err
    code, err = run_main(capsys, "serve", "--model", str(tmp_path / "nowhere"))
    assert code == 2 and "--model: " in err and "is not a directory" in err
    code, err = run_main(capsys, "serve", "--model", str(tmp_path))
    assert code == 2 and "has no config.json" in err


def test_serve_reports_a_port_in_use_before_loading_torch():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        script = ("import sys\nfrom kvpilot.engine.cli import main\n"
                  f"rc = main(['serve', '--model', 'builtin:tiny', '--host', '127.0.0.1', '--port', '{port}'])\n"
                  "print('torch loaded' if 'torch' in sys.modules else 'no torch', rc)")
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.stdout.split() == ["no", "torch", "2"], out
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}" in out.stderr and "Traceback" not in out.stderr


def test_bench_serve_to_a_dead_port_is_one_line(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    code, err = run_main(capsys, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "m",
                         "--num-prompts", "1", "--disable-tqdm")
    assert code == 2 and error_lines(err) == [err.strip()] and "cannot reach" in err


@pytest.mark.parametrize("command", ["gateway", "operator"])
def test_gateway_and_operator_without_a_kubeconfig_are_one_line(capsys, monkeypatch, tmp_path, command):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    code, err = run_main(capsys, command)
    assert code == 2 and error_lines(err) == [err.strip()] and "no Kubernetes API configuration" in err


def test_sim_run_takes_a_scenarios_accelerator_and_model(capsys, monkeypatch):
    from kvpilot.engine.fleet import fleet
    from kvpilot.engine.fleet.scenarios import scenario

    seen = {}

    class Stop(Exception):
        pass

    def fake_fleet(config, **kwargs):
        seen["config"] = config
        raise Stop()
    monkeypatch.setattr(fleet, "Fleet", fake_fleet)
    code, err = run_main(capsys, "sim", "run", "--scenario", "preemption", "--max-num-seqs", "64")
    expected = scenario("preemption")
    config = seen["config"]
    assert config.simulate.accelerator == expected.accelerator and config.max_num_seqs == 64
    assert code == 1 and error_lines(err) == [err.strip()] and "Stop" in err  # any failure: one line


def test_an_unexpected_failure_is_one_line_and_exit_1(capsys, monkeypatch):
    from kvpilot.engine import cli

    def boom(args):
        raise RuntimeError("disk on fire\nsecond line")
    parser = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda: _with_func(parser(), boom))
    code, err = run_main(capsys, "crd")
    assert code == 1 and err.strip() == ("kvpilot crd: error: RuntimeError: disk on fire "
                                         "(--log-level DEBUG shows the traceback)")


def _with_func(parser, func):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            action.choices["crd"].set_defaults(func=func)
    return parser


def test_serve_says_what_it_is_doing_while_it_starts(caplog, monkeypatch):
    import logging

    from kvpilot.engine.server import cli as server_cli

    seen = []
    monkeypatch.setattr(server_cli, "_serve", lambda args, what, done, started: seen.append(what[0]) or 0)
    with caplog.at_level(logging.INFO, logger="kvpilot.server"):
        assert main(["serve", "--model", "builtin:tiny", "--host", "127.0.0.1", "--port", "0"]) == 0
    assert "kvpilot serve: importing the engine (torch)" in caplog.text and seen == ["importing the engine (torch)"]
