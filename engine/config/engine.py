"""Engine settings: one dataclass, validated once at the edge (CLI, server, LLM())."""

from __future__ import annotations

from dataclasses import dataclass, field

from .quantity import parse_bytes
from .simulation import SimulationConfig
from .speculative import SpeculativeConfig
from .validation import positive_int

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "triton", "torch")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
# int8, int4: quantize-at-load schemes (engine/quant/quantize.py); compressed-tensors, gptq, awq:
# vLLM's names for what a checkpoint in that format gets anyway (engine/quant/formats.py).
QUANTIZATION_CHOICES = ("int8", "int4", "compressed-tensors", "gptq", "awq")
BLOCK_SIZES = (8, 16, 32, 64, 128)
# vLLM's --kv-cache-dtype values: auto = the model's dtype; fp8 = fp8_e4m3 (kv_cache_dtype.py).
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e4m3")
MAX_PARALLEL_SIZE = 16  # ranks of one kind on one node (the operator's resources.gpus limit too)
DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30  # 1 GiB when the user gives nothing on CPU


def setting(default, help: str, **flag) -> object:
    """A field with the help text (and argparse extras: choices, exclusive) its flag takes."""
    return field(default=default, metadata={"help": help, **flag})


@dataclass
class EngineConfig:
    """Every engine setting, once: `kvpilot serve/generate/bench/sim` generate their
    flags from these fields (flags.py), named as vLLM names them."""

    model: str | None = setting(
        None, "model directory, file:///PATH, hf://ORG/NAME[@REV], s3://BUCKET/PREFIX or builtin:tiny (with --simulate: optional)")
    served_model_name: str | None = setting(None, "the model name the API answers to (default: --model)")
    dtype: str = setting("auto", "weights' and activations' dtype (auto: the checkpoint's; float32 on CPU)",
                          choices=DTYPE_CHOICES)
    device: str = setting("auto", "where the model runs (auto: cuda when present)", choices=DEVICE_CHOICES)
    max_num_seqs: int = setting(256, "most sequences in one step's batch (live-tunable)")
    max_model_len: int | None = setting(
        None, "longest prompt + output (live-tunable; default: the model's max_position_embeddings)")
    max_num_batched_tokens: int = setting(2048, "most tokens in one step (the chunked-prefill budget)")
    block_size: int = setting(16, "tokens per KV cache block", choices=BLOCK_SIZES)
    kv_cache_memory: int | str | None = setting(
        None, "KV cache size in bytes (64Mi, 1G and plain integers work); CPU default 1Gi",
        exclusive="kv_cache_size")
    gpu_memory_utilization: float = setting(
        0.9, "fraction of the GPU's memory for weights, activations and the KV cache",
        exclusive="kv_cache_size")
    kv_cache_dtype: str = setting(
        "auto", "the KV cache's storage dtype (auto: the model's; fp8 = fp8_e4m3: one byte per "
                "element with per-layer K/V scales, twice a 16-bit cache's tokens in the same "
                "memory)", choices=KV_CACHE_DTYPE_CHOICES)
    enable_prefix_caching: bool = setting(True, "share the KV blocks of identical prompt prefixes")
    attention_backend: str = setting("auto", "paged attention kernels (auto: triton on CUDA, torch "
                                      "on CPU)", choices=ATTENTION_BACKENDS)
    enforce_eager: bool = setting(
        False, "run every step eagerly: no CUDA graphs (on CUDA, decode steps are otherwise "
               "replayed from graphs captured at start-up per batch-size bucket)")
    quantization: str | None = setting(
        None, "quantize the decoder's linear layers at load (the embedding and LM head stay "
              "float): int8 = W8A16 per-channel symmetric, int4 = W4A16 group-wise with zero "
              "points (default: float weights). A quantized checkpoint (compressed-tensors "
              "W4A16/W8A16, GPTQ 4/8-bit, AWQ 4-bit GEMM) is read as its config.json says, with "
              "or without its name here", choices=QUANTIZATION_CHOICES)
    tensor_parallel_size: int = setting(
        1, "GPUs (CPU: processes) one engine spreads each layer over, Megatron-style: q/k/v and "
           "gate/up split by column, o and down by row with one all-reduce each, the embedding "
           "and LM head by vocabulary, the KV cache by KV head (num_key_value_heads must divide "
           "by it); one worker process per rank, NCCL on CUDA, gloo on the CPU")
    pipeline_parallel_size: int = setting(
        1, "pipeline stages the decoder layers are split into, one process per stage (times "
           "tensor_parallel_size), with the step's sequences split into micro-batches in flight")
    pipeline_micro_batches: int | None = setting(
        None, "micro-batches a step is cut into for the pipeline (default: pipeline_parallel_size; "
              "at most the step's sequences): more shrink the idle bubble (p-1)/(m+p-1), smaller "
              "ones use each stage's matmuls less well")
    seed: int = setting(0, "torch's global seed, and the base of unseeded requests' seeds")
    cpu_threads: int | None = setting(
        None, "torch's intra-op threads on the CPU (default: torch's, one per core); fewer leave "
              "cores to the HTTP server and its clients, as vLLM's CPU backend does")
    speculative_config: str | dict | SpeculativeConfig | None = setting(
        None, "speculative decoding as vLLM takes it, a JSON object: "
              "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' "
              "(num_speculative_tokens is live-tunable; 0 turns speculation off; with --simulate "
              "it is modelled: --simulate-spec-acceptance, --simulate-spec-draft-cost)")
    # Its own flags (--simulate, --simulate-*), from SimulationConfig's fields.
    simulate: SimulationConfig | None = field(default=None, metadata={"flag": False})

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
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        # With simulate, speculation is modelled (sim/speculation.py): a draft_model's `model`
        # must still be named (the same config runs on real pods) but is never loaded.
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.device not in DEVICE_CHOICES:
            raise ValueError(f"device must be one of {DEVICE_CHOICES}, got {self.device!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES} (or None for float "
                             f"weights), got {self.quantization!r}")
        if self.quantization is not None and self.simulate is not None:
            # The simulated accelerator models float weights only: never report a quantized
            # deployment's memory and speed as if it were float.
            raise ValueError(f"quantization={self.quantization!r} is not modelled by --simulate "
                             "(its weights and step times are float's); drop one of them")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPE_CHOICES}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and self.simulate is not None:
            # The simulator sizes its KV cache in the model's dtype: never report fp8's capacity as float's.
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not modelled by --simulate "
                             "(its cache holds the model's dtype); drop one of them")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size",
                     "pipeline_parallel_size"):
            positive_int(name, getattr(self, name))
        if self.cpu_threads is not None and (isinstance(self.cpu_threads, bool) or not isinstance(
                self.cpu_threads, int) or not 1 <= self.cpu_threads <= 1024):
            raise ValueError(f"cpu_threads must be an integer in [1, 1024], got {self.cpu_threads!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) > MAX_PARALLEL_SIZE:
                raise ValueError(f"{name} must be at most {MAX_PARALLEL_SIZE} (one process per rank "
                                 f"on one node), got {getattr(self, name)}")
        if self.pipeline_micro_batches is not None:
            positive_int("pipeline_micro_batches", self.pipeline_micro_batches)
            if self.pipeline_micro_batches > 1024:
                raise ValueError(f"pipeline_micro_batches must be at most 1024, got {self.pipeline_micro_batches}")
        if self.world_size > 1 and self.quantization is not None and self.simulate is None:
            raise ValueError(f"quantization={self.quantization!r} with tensor_parallel_size/"
                             "pipeline_parallel_size > 1 is not implemented (the sharded loader reads "
                             "float weights); drop one of them")
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {BLOCK_SIZES}, got {self.block_size}")
        if self.max_model_len is not None:
            positive_int("max_model_len", self.max_model_len)
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes("kv_cache_memory", self.kv_cache_memory)
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    @property
    def world_size(self) -> int:
        """Ranks one engine runs on: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
