"""Simulation settings: which accelerator and model to model, validated once."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist

from .quantity import parse_bytes

DEFAULT_OUTPUT_LEN = "lognormal:256:1.0"
# The links engine/sim/hardware.py models (its INTERCONNECTS, which a test holds to this list):
# named here so that the setting is checked where it is read, without the simulator.
INTERCONNECT_NAMES = ("nvlink4", "nvlink3", "pcie5", "pcie4")


@dataclass(frozen=True)
class OutputLengths:
    """Where EOS comes for a request that does not ignore it: `KIND:ARGS` with
    fixed:N, uniform:LO:HI, exponential:MEAN or lognormal:MEDIAN:SIGMA."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str, field: str = "simulate_output_len") -> OutputLengths:
        kind, _, rest = str(text).partition(":")
        args = rest.split(":") if rest else []
        arity = {"fixed": 1, "uniform": 2, "exponential": 1, "lognormal": 2}
        if kind not in arity:
            raise ValueError(f"{field}: unknown distribution {kind!r}; use fixed:N, uniform:LO:HI, "
                             f"exponential:MEAN or lognormal:MEDIAN:SIGMA")
        if len(args) != arity[kind]:
            raise ValueError(f"{field}: {kind} takes {arity[kind]} number(s), got {text!r}")
        try:
            values = [float(v) for v in args]
        except ValueError:
            raise ValueError(f"{field}: {text!r} has a value that is not a number") from None
        if any(not math.isfinite(v) or v <= 0 for v in values):
            raise ValueError(f"{field}: values must be positive and finite, got {text!r}")
        if kind == "uniform" and values[0] > values[1]:
            raise ValueError(f"{field}: uniform:LO:HI needs LO <= HI, got {text!r}")
        return cls(kind, *values)

    def sample(self, u: float) -> int:
        """The length at quantile u in [0, 1); at least 1."""
        if self.kind == "fixed":
            n = self.a
        elif self.kind == "uniform":
            n = self.a + u * (self.b - self.a + 1)
        elif self.kind == "exponential":
            n = -self.a * math.log1p(-u)
        else:
            n = self.a * math.exp(self.b * NormalDist().inv_cdf(min(max(u, 1e-12), 1 - 1e-12)))
        return max(1, int(n))

    def __str__(self) -> str:
        args = [self.a] + ([self.b] if self.kind in ("uniform", "lognormal") else [])
        return self.kind + "".join(f":{v:g}" for v in args)



@dataclass
class SimulationConfig:
    accelerator: str = field(metadata={
        "help": "accelerator to model: h200, h100-80gb, a100-80gb, l40s, l4, a10g, or a JSON "
                "file of accelerator fields"})
    model: str | None = field(default=None, metadata={
        "help": "model shape: llama-3.1-8b, llama-3.1-70b, qwen2.5-7b, mistral-7b, a config.json "
                "or a model directory (default: --model)"})
    calibration: str | None = field(default=None, metadata={
        "help": "JSON from `kvpilot sim calibrate`: fitted overheads and achievable fractions"})
    memory: int | str | None = field(default=None, metadata={
        "help": "override the accelerator's memory (bytes; 40Gi, 80G)"})
    bandwidth_gbps: float | None = field(default=None, metadata={
        "help": "override the accelerator's peak memory bandwidth, GB/s"})
    tflops: float | None = field(default=None, metadata={
        "help": "override the accelerator's dense bf16 peak, TFLOP/s"})
    interconnect: str | None = field(default=None, metadata={
        "help": "with --tensor-parallel-size > 1: the link the all-reduces cross, nvlink4 "
                "(H100/H200 SXM), nvlink3 (A100 SXM), pcie5 or pcie4 (default: the "
                "accelerator's, pcie4 for L40S, L4, A10G and JSON files that name none)"})
    output_len: str = field(default=DEFAULT_OUTPUT_LEN, metadata={
        "help": "where EOS comes unless a request ignores it: fixed:N, uniform:LO:HI, "
                "exponential:MEAN or lognormal:MEDIAN:SIGMA"})
    load_seconds: float = field(default=0.0, metadata={
        "help": "seconds the simulated model takes to load before the server is ready (a real "
                "8B model: about a minute of weights, compile and CUDA graphs); default 0"})
    spec_acceptance: float = field(default=0.7, metadata={
        "help": "with --speculative-config: the chance each draft token is the one the model "
                "would produce (independent per position, fixed by the request's seed and the "
                "position); both methods draft this way in the simulator, in (0, 1]"})
    spec_draft_cost: float | None = field(default=None, metadata={
        "help": "with --speculative-config: one draft-model pass's time as a fraction of a "
                "target decode step over the same sequences, charged K times per step that "
                "verifies drafts; in [0, 1] (default: 0 for ngram, 0.1 for draft_model)"})
    output_lengths: OutputLengths = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.accelerator, str) or not self.accelerator:
            raise ValueError("simulate: name an accelerator (h100-80gb, ...) or a JSON file")
        if self.memory is not None:
            self.memory = parse_bytes("simulate_memory", self.memory)
        for name in ("bandwidth_gbps", "tflops"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 < value < 1e7):
                raise ValueError(f"simulate_{name} must be a positive number, got {value!r}")
        if self.interconnect is not None and self.interconnect not in INTERCONNECT_NAMES:
            raise ValueError(f"simulate_interconnect must be one of {', '.join(INTERCONNECT_NAMES)}, "
                             f"got {self.interconnect!r}")
        v = self.load_seconds
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 3600:
            raise ValueError(f"simulate_load_seconds must be a number in [0, 3600], got {v!r}")
        v = self.spec_acceptance
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
            raise ValueError(f"simulate_spec_acceptance must be a number in (0, 1], got {v!r}")
        v = self.spec_draft_cost
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1):
            raise ValueError(f"simulate_spec_draft_cost must be a number in [0, 1], got {v!r}")
        self.output_lengths = OutputLengths.parse(self.output_len)
