"""The engine's flags come from EngineConfig's fields: one declaration per setting."""
from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from kvpilot.engine.cli import build_parser
from kvpilot.engine.config.args import add_engine_args, engine_config_from_args
from kvpilot.engine.config.engine import EngineConfig

FLAGGED = [f for f in fields(EngineConfig) if f.metadata.get("flag", True)]
ENGINE_COMMANDS = [["serve"], ["generate", "--prompt", "x"], ["bench", "throughput"],
                   ["sim", "run", "--scenario", "day"], ["sim", "describe"], ["sim", "record", "--grid", "calibration",
                                                          "--out", "o.json"]]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def test_every_setting_but_simulate_has_a_flag_with_help():
    by_dest = {a.dest: a for a in _parser()._actions}
    assert {f.name for f in fields(EngineConfig)} - {f.name for f in FLAGGED} == {"simulate"}
    for f in FLAGGED:
        action = by_dest[f.name]
        assert action.option_strings[0] == "--" + f.name.replace("_", "-")
        assert f.metadata["help"] and action.help.startswith(f.metadata["help"])
        if f.default is not None:
            assert f"(default: {f.default})" in action.help
        assert action.choices == f.metadata.get("choices", action.choices)


@pytest.mark.parametrize("command", ENGINE_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_no_flags_give_the_dataclass_defaults(command):
    args = build_parser().parse_args([*command, "--model", "builtin:tiny"])
    assert engine_config_from_args(args) == EngineConfig(model="builtin:tiny")


def test_given_flags_reach_the_config_with_their_types():
    args = _parser().parse_args(["--model", "m", "--max-num-seqs", "8", "--block-size", "32",
                                 "--no-enable-prefix-caching", "--kv-cache-memory", "64Mi",
                                 "--cpu-threads", "1", "--dtype", "float32"])
    c = engine_config_from_args(args)
    assert (c.max_num_seqs, c.block_size, c.enable_prefix_caching) == (8, 32, False)
    assert (c.kv_cache_memory, c.cpu_threads, c.dtype) == (64 << 20, 1, "float32")


def test_choices_and_exclusive_groups_are_enforced_by_argparse(capsys):
    for argv in (["--block-size", "24"], ["--dtype", "int3"],
                 ["--kv-cache-memory", "1G", "--gpu-memory-utilization", "0.5"]):
        with pytest.raises(SystemExit):
            _parser().parse_args(argv)
    assert "not allowed with argument" in capsys.readouterr().err


def test_values_argparse_accepts_are_still_validated_by_the_config():
    args = _parser().parse_args(["--model", "m", "--max-num-seqs", "0"])
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine_config_from_args(args)
