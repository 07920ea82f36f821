"""Multi-GPU engines: how resources.gpus and spec.engine.tensorParallelSize /
pipelineParallelSize become the engine's --tensor-parallel-size and
--pipeline-parallel-size, and the rules that keep them consistent.

One pod runs one engine, and resources.gpus: N is all of it: by default the engine spreads
each layer over the N GPUs (--tensor-parallel-size N). The spec may split them otherwise,
tensorParallelSize x pipelineParallelSize = N (one rank a GPU). Without GPUs (gpus: 0) the
sizes are the CPU engine's worker processes (shared memory, a Memory emptyDir at /dev/shm), or the simulated accelerator's GPUs
with engine.simulate. Either way the engine exports the KV cache of all its ranks
(kvpilot:kv_cache_bytes and kvpilot:kv_cache_bytes_per_token, every rank's together), so
the capacity planner needs no GPU count of its own."""
from __future__ import annotations

from .engine import PARALLEL_USES_ALL_GPUS, PIPELINE_NOT_SIMULATED
from .fields import InvalidSpec
from .spec import LLMDeploymentSpec

PARALLEL_FLAGS = ("--tensor-parallel-size", "--pipeline-parallel-size")
EXTRA_ARGS_SET_PARALLEL = ("engine.extraArgs may not set --tensor-parallel-size or --pipeline-parallel-size: "
                           "use engine.tensorParallelSize and engine.pipelineParallelSize")


def parallel_sizes(spec: LLMDeploymentSpec) -> tuple[int, int]:
    """(tensor_parallel_size, pipeline_parallel_size) the engine runs with."""
    e, gpus = spec.engine, spec.resources.gpus
    pipeline = e.pipeline_parallel_size or 1
    if e.tensor_parallel_size is not None:
        return e.tensor_parallel_size, pipeline
    return (max(gpus // pipeline, 1) if gpus > 0 else 1), pipeline


def parallel_args(spec: LLMDeploymentSpec) -> list[str]:
    """The engine's flags; none at size 1 (the engine's default), so single-GPU and CPU pods
    render as before and do not roll."""
    tensor, pipeline = parallel_sizes(spec)
    args = ["--tensor-parallel-size", str(tensor)] if tensor > 1 else []
    return args + (["--pipeline-parallel-size", str(pipeline)] if pipeline > 1 else [])


def validate_parallel(spec: LLMDeploymentSpec) -> None:
    """The CEL rules again, and what CEL cannot see: a simulated preset's KV heads (the
    engine refuses a tensor_parallel_size that does not divide them) and extraArgs that
    would override the sizes behind the rules' back (the extraArgs' strings have no length
    bound, so a CEL rule over them would exceed the API server's cost budget)."""
    e, gpus = spec.engine, spec.resources.gpus
    tensor, pipeline = parallel_sizes(spec)
    if gpus > 0 and tensor * pipeline != gpus:
        raise InvalidSpec(f"{PARALLEL_USES_ALL_GPUS}; got {tensor} x {pipeline} for {gpus} GPUs")
    if any(arg.partition("=")[0] in PARALLEL_FLAGS for arg in e.extra_args):
        raise InvalidSpec(EXTRA_ARGS_SET_PARALLEL)
    sim = e.simulate
    if sim is None:
        return
    if pipeline > 1:
        raise InvalidSpec(PIPELINE_NOT_SIMULATED)
    if sim.model is not None:
        from kvpilot.engine.sim.shapes import PRESETS

        heads = PRESETS[sim.model]["num_key_value_heads"]
        if heads % tensor:
            raise InvalidSpec(f"tensor parallel size {tensor} (engine.tensorParallelSize, by default "
                              f"resources.gpus) must divide {sim.model}'s num_key_value_heads ({heads}): "
                              f"each GPU holds an equal share of the KV heads")
