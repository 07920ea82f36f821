"""Engine settings: one dataclass, validated once at the edge (CLI, server, LLM())."""

from __future__ import annotations

from dataclasses import dataclass

from .quantity import parse_bytes
from .sim.config import SimulationConfig
from .validation import positive_int

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "triton", "torch")
DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30  # 1 GiB when the user gives nothing on CPU


@dataclass
class EngineConfig:
    model: str | None  # a model directory or builtin:tiny; with `simulate`, may be left out
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: int | str | None = None  # bytes; CPU default 1 GiB
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    seed: int = 0
    cpu_threads: int | None = None  # torch's intra-op threads on the CPU (None: torch's default)
    simulate: SimulationConfig | None = None  # a timing model in place of the forward pass

    def __post_init__(self) -> None:
        if isinstance(self.simulate, dict):
            self.simulate = SimulationConfig(**self.simulate)
        if self.simulate is not None:
            if not self.simulate.model:
                if not self.model:
                    raise ValueError("simulate_model: name a model shape (llama-3.1-8b, a "
                                     "config.json, ...) or give model")
                self.simulate.model = self.model
            self.model = self.model or self.simulate.model
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a model directory or builtin:tiny")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            positive_int(name, getattr(self, name))
        if self.cpu_threads is not None and (isinstance(self.cpu_threads, bool) or not isinstance(
                self.cpu_threads, int) or not 1 <= self.cpu_threads <= 1024):
            raise ValueError(f"cpu_threads must be an integer in [1, 1024], got {self.cpu_threads!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.max_model_len is not None:
            positive_int("max_model_len", self.max_model_len)
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes("kv_cache_memory", self.kv_cache_memory)
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
