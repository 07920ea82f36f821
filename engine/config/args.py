"""The engine's flags: EngineConfig's fields, then the simulated accelerator's
(--simulate, --simulate-*) from SimulationConfig's, shared by every command that
starts an engine (serve, generate, bench throughput, sim, autotune simulate)."""

from __future__ import annotations

import argparse

from .engine import EngineConfig
from .flags import add_dataclass_flags, dataclass_from_args
from .simulation import SimulationConfig

SIMULATE_PREFIX = "simulate_"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags from EngineConfig's fields, and the simulated accelerator's from
    SimulationConfig's."""
    add_dataclass_flags(p.add_argument_group("engine"), EngineConfig, "")
    sim = p.add_argument_group(
        "simulated accelerator", "the real scheduler, KV cache manager, server and metrics, with "
        "the forward pass replaced by a timing model (no GPU, no weights)")
    add_dataclass_flags(sim, SimulationConfig, SIMULATE_PREFIX, {"accelerator": "--simulate"})


def simulation_config_from_args(args: argparse.Namespace) -> SimulationConfig | None:
    if getattr(args, "simulate_accelerator", None) is None:
        given = [f"--{k.replace('_', '-')}" for k, v in vars(args).items()
                 if k.startswith(SIMULATE_PREFIX) and v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need --simulate ACCELERATOR")
        return None
    return dataclass_from_args(SimulationConfig, args, SIMULATE_PREFIX)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return dataclass_from_args(EngineConfig, args, "", simulate=simulation_config_from_args(args))
