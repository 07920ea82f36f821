"""What a simulated spec (engine.simulate) adds to the engine pod: the
`--simulate*` flags, the model shape's ConfigMap, the label users select
simulated pods by, and the short form status.simulated shows."""
from __future__ import annotations

from .objects import TUNING_DIR
from ..api.parallel import parallel_sizes
from ..api.spec import LLMDeploymentSpec
from ..names import GROUP
from ..api.model import SimulateSpec

SIMULATED_LABEL = f"{GROUP}/simulated"
SIM_MODEL_SUBDIR = "sim-model"
SIM_MODEL_DIR = f"{TUNING_DIR}/{SIM_MODEL_SUBDIR}"


def simulate_args(sim: SimulateSpec) -> list[str]:
    model = sim.model if sim.model is not None else f"{SIM_MODEL_DIR}/{sim.model_config_map.key}"
    args = ["--simulate", sim.accelerator, "--simulate-model", model]
    if sim.output_len is not None:
        args += ["--simulate-output-len", sim.output_len]
    if sim.load_seconds:
        args += ["--simulate-load-seconds", f"{sim.load_seconds:g}"]
    if sim.interconnect is not None:
        args += ["--simulate-interconnect", sim.interconnect]
    return args


def sim_model_projection(sim: SimulateSpec) -> dict | None:
    """The config.json as a projected-volume source beside the tuning file, so it appears at
    SIM_MODEL_DIR/<key>. Not a volume of its own mounted there: ConfigMap volumes are
    read-only, so the runtime could not create a mount point inside the tuning volume."""
    ref = sim.model_config_map
    if ref is None:
        return None
    return {"configMap": {"name": ref.name, "items": [{"key": ref.key, "path": f"{SIM_MODEL_SUBDIR}/{ref.key}"}]}}


def simulated_summary(spec: LLMDeploymentSpec) -> str | None:
    """status.simulated: ACCEL/MODEL, or ACCEL/configmap:NAME, with Nx before ACCEL when one
    engine spans N simulated GPUs; None for a real GPU or CPU pod."""
    sim = spec.engine.simulate
    if sim is None:
        return None
    model = sim.model if sim.model is not None else f"configmap:{sim.model_config_map.name}"
    gpus = parallel_sizes(spec)[0]
    return f"{f'{gpus}x' if gpus > 1 else ''}{sim.accelerator}/{model}"
