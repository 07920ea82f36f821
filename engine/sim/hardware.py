"""Accelerators the timing model knows: peak figures from the vendors' datasheets, and
the fractions of them a serving engine achieves (replaceable by a calibration file).

Peak figures are dense (no 2:4 sparsity) bf16/fp16 tensor-core FLOP/s and HBM/GDDR
bandwidth as the datasheets state them (SXM parts where there are two forms). Memory is
what the driver reports for the part (nvidia-smi's total, e.g. 81559 MiB on an H100 80GB),
not the marketing figure:
- H200 SXM: 141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s (NVIDIA H200 datasheet; 1,979 sparse).
- H100 SXM 80GB: 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s (NVIDIA H100 datasheet; 1,979 sparse).
- A100 SXM 80GB: 80 GB HBM2e, 2,039 GB/s, 312 TFLOP/s (NVIDIA A100 datasheet; 624 sparse).
- L40S: 48 GB GDDR6, 864 GB/s, 362 TFLOP/s (NVIDIA L40S datasheet; 733 sparse).
- L4: 24 GB GDDR6, 300 GB/s, 121 TFLOP/s (NVIDIA L4 datasheet; 242 sparse).
- A10G: 24 GB GDDR6, 600 GB/s, 125 TFLOP/s: NVIDIA's A10 datasheet (250 sparse). AWS's
  A10G (G5 instances) is a variant of the A10 with no datasheet of its own.

Achievable fractions default to what microbenchmarks of these parts commonly show:
large bf16 GEMMs at about 70 % of the dense peak, FlashAttention-style kernels at about
45 %, device-memory streaming at about 85 % of the bandwidth peak. The per-step overhead
(scheduling, input preparation, kernel launches) defaults to 1 ms plus 15 us per
sequence: with CUDA graphs, vLLM's batch-1 decode of Llama-3.1-8B runs within about 1 ms
of the weight-streaming time on H100 and A100 (docs/simulator.md, "Calibration and fidelity"). `kvpilot sim
calibrate` replaces all of these from measured step times.

Interconnects (what tensor parallelism's all-reduces cross, engine/sim/parallel.py): an
effective all-reduce bus bandwidth per direction and a latency per ring step, from
datasheets and published nccl-tests runs:
- nvlink4 (H100/H200 SXM, NVSwitch): 450 GB/s, the datasheet's 900 GB/s bidirectional
  NVLink halved; nccl-tests all_reduce_perf on 8x H100 SXM reaches a busbw of 460-480 GB/s
  (docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests, reference table). 0.6 us a
  ring step: a 1 KB ring all-reduce over 4 NVLink H800s takes 3.5 us without CUDA graphs,
  6 steps (github.com/NVIDIA/nccl/issues/1984).
- nvlink3 (A100 SXM): 230 GB/s, the busbw measured on 8x A100 SXM4 (200-250 GB/s:
  github.com/NVIDIA/nccl-tests/issues/149 and the table above) against a datasheet 300 GB/s
  a direction (600 GB/s bidirectional); 0.6 us a step, as nvlink4.
- pcie5 (PCIe Gen5 x16, no NVLink: H100 PCIe): 35 GB/s, the table above's 35-45 GB/s for
  8x H100 PCIe, and 35 GB/s on 4 PCIe Gen5 GPUs (github.com/NVIDIA/nccl/issues/1639); 3 us a
  step: an 8-byte all-reduce over 8 PCIe GPUs takes 42 us, 14 steps
  (github.com/NVIDIA/nccl/issues/1530).
- pcie4 (PCIe Gen4 x16, no NVLink: L40S, L4, A10G): 20 GB/s, below the 24 GB/s NCCL's
  topology search assigns a Gen4 x16 link (its log's "PCI[24.0]",
  github.com/NVIDIA/nccl-tests/issues/307); 3 us a step, as pcie5."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

GB = 10**9
TB = 10**12


@dataclass(frozen=True)
class Interconnect:
    """The GPU-to-GPU link one tensor-parallel engine's all-reduces cross."""

    name: str
    bus_bandwidth: float  # bytes/s per direction, what a ring all-reduce's busbw reaches
    step_latency_s: float  # per ring step (one send/receive hop)
    source: str = ""


INTERCONNECTS: dict[str, Interconnect] = {i.name: i for i in (
    Interconnect("nvlink4", 450 * GB, 0.6e-6, "NVLink 4 + NVSwitch (H100/H200 SXM)"),
    Interconnect("nvlink3", 230 * GB, 0.6e-6, "NVLink 3 + NVSwitch (A100 SXM)"),
    Interconnect("pcie5", 35 * GB, 3e-6, "PCIe Gen5 x16, no NVLink"),
    Interconnect("pcie4", 20 * GB, 3e-6, "PCIe Gen4 x16, no NVLink"),
)}


def resolve_interconnect(name: str) -> Interconnect:
    if name not in INTERCONNECTS:
        raise ValueError(f"simulate_interconnect: unknown interconnect {name!r}; one of {', '.join(INTERCONNECTS)}")
    return INTERCONNECTS[name]


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_bytes: int
    bandwidth: float  # bytes/s, the datasheet's peak
    flops: float  # dense bf16/fp16 FLOP/s, the datasheet's peak
    bandwidth_efficiency: float = 0.85
    gemm_efficiency: float = 0.70
    attention_efficiency: float = 0.45
    step_overhead_s: float = 1e-3
    per_seq_overhead_s: float = 15e-6
    per_token_overhead_s: float = 0.0  # host work per scheduled token (input prep)
    # Bytes moved per (query, key) pair per head by attention that materialises its score
    # matrix (a plain softmax(QK^T)V, as the CPU reference does); 0 for fused kernels.
    attention_score_bytes: float = 0.0
    reserved_bytes: int = 1 << 30  # CUDA context, library workspaces, graphs: not for KV
    interconnect: str = "pcie4"  # between GPUs of one engine (INTERCONNECTS): the part's usual link
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "bandwidth", "flops"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"accelerator {self.name}: {name} must be a positive number, got {value!r}")
        for name in ("bandwidth_efficiency", "gemm_efficiency", "attention_efficiency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"accelerator {self.name}: {name} must be in (0, 1], got {value!r}")
        for name in ("step_overhead_s", "per_seq_overhead_s", "per_token_overhead_s", "reserved_bytes",
                     "attention_score_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"accelerator {self.name}: {name} must be a non-negative number, got {value!r}")
        if self.interconnect not in INTERCONNECTS:
            raise ValueError(f"accelerator {self.name}: interconnect must be one of {list(INTERCONNECTS)}, "
                             f"got {self.interconnect!r}")

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth * self.bandwidth_efficiency

    @property
    def effective_gemm_flops(self) -> float:
        return self.flops * self.gemm_efficiency

    @property
    def effective_attention_flops(self) -> float:
        return self.flops * self.attention_efficiency

    def to_json(self) -> dict:
        return asdict(self)


MIB = 2**20


def _preset(name: str, memory_mib: int, bandwidth_gbps: float, tflops: float, interconnect: str,
            source: str) -> Accelerator:
    return Accelerator(name=name, memory_bytes=memory_mib * MIB, bandwidth=bandwidth_gbps * GB,
                       flops=tflops * TB, interconnect=interconnect, source=source)


PRESETS: dict[str, Accelerator] = {a.name: a for a in (
    _preset("h200", 143771, 4800, 989, "nvlink4", "NVIDIA H200 datasheet (SXM)"),
    _preset("h100-80gb", 81559, 3350, 989, "nvlink4", "NVIDIA H100 datasheet (SXM)"),
    _preset("a100-80gb", 81920, 2039, 312, "nvlink3", "NVIDIA A100 datasheet (SXM 80GB)"),
    _preset("l40s", 46068, 864, 362, "pcie4", "NVIDIA L40S datasheet"),
    _preset("l4", 23034, 300, 121, "pcie4", "NVIDIA L4 datasheet"),
    _preset("a10g", 23028, 600, 125, "pcie4", "NVIDIA A10 datasheet (AWS A10G is its variant)"),
)}

# Fields a calibration file may set (a fitted overhead and fractions; peaks stay the datasheet's).
CALIBRATED_FIELDS = ("bandwidth_efficiency", "gemm_efficiency", "attention_efficiency",
                     "step_overhead_s", "per_seq_overhead_s", "per_token_overhead_s",
                     "attention_score_bytes")


def _read_json(path: Path, what: str) -> dict:
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what}: {path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{what}: {path} must hold a JSON object")
    return raw


def _from_dict(raw: dict, origin: str) -> Accelerator:
    # A file written by `kvpilot sim calibrate` also carries its fit report.
    raw = {k: v for k, v in raw.items() if k not in ("fitted", "fit")}
    known = {f.name for f in fields(Accelerator)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{origin}: unknown accelerator field(s) {unknown}; known: {sorted(known)}")
    missing = [n for n in ("name", "memory_bytes", "bandwidth", "flops") if n not in raw]
    if missing:
        raise ValueError(f"{origin}: missing accelerator field(s) {missing}")
    return Accelerator(**raw)


def resolve_accelerator(spec: str, calibration: str | None = None, *, memory_bytes: int | None = None,
                        bandwidth: float | None = None, flops: float | None = None) -> Accelerator:
    """A preset name or a JSON file of Accelerator fields, then a calibration file's
    fitted fields, then explicit overrides (from flags)."""
    if spec in PRESETS:
        acc = PRESETS[spec]
    elif spec.endswith(".json") or Path(spec).is_file():
        acc = _from_dict(_read_json(Path(spec), "simulate"), f"simulate: {spec}")
    else:
        raise ValueError(f"simulate: unknown accelerator {spec!r}; presets: {', '.join(PRESETS)} "
                         f"(or a JSON file of accelerator fields)")
    if calibration:
        raw = _read_json(Path(calibration), "simulate_calibration")
        fitted = raw.get("fitted", raw)
        if not isinstance(fitted, dict):
            raise ValueError(f"simulate_calibration: {calibration}: 'fitted' must be an object")
        unknown = sorted(set(fitted) - set(CALIBRATED_FIELDS))
        if unknown:
            raise ValueError(f"simulate_calibration: {calibration}: unknown field(s) {unknown}; "
                             f"a calibration sets {list(CALIBRATED_FIELDS)}")
        acc = replace(acc, **fitted, name=f"{acc.name}+calibrated")
    overrides = {k: v for k, v in (("memory_bytes", memory_bytes), ("bandwidth", bandwidth),
                                   ("flops", flops)) if v is not None}
    if overrides:
        acc = replace(acc, **overrides, name=f"{acc.name}+custom")
    return acc
