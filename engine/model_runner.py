"""The real executor: loads the model in torch, owns the paged KV cache, runs one step."""

from __future__ import annotations

import logging
import torch

from .attention import PagedAttention, resolve_backend
from .attention_metadata import AttentionMetadata
from .config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig
from .cpu_attention import plan_torch_attention
from .cpu_decode_kernel import load_decode_kernel
from .cuda_graphs import DecodeGraphs, DecodeRows, capture_sizes
from .cpu_linear import pack_linears, packed_linear_available
from .cpu_malloc import keep_freed_memory
from .cpu_threads import release_openmp_pool
from .device import pick_device, pick_dtype
from .draft_model import DraftModel
from .executor import StepResult
from .kv_cache_dtype import FP8, resolve_kv_cache_dtype
from .model_config import ModelConfig
from .models.llama import LlamaForCausalLM
from .outputs import TokenLogprob
from .quant_checkpoint_load import load_quantized_checkpoint
from .quantization import quantize_decoder, weight_bytes
from .request import Request
from .sampler import Sampler, SamplerOutput, SamplingBatch
from .scheduler import SchedulerOutput
from .spec_verify import verify_step
from .step_inputs import BlockTables, StepInputs
from .step_staging import StagedStep, StepStaging
from .weights import iter_safetensors

log = logging.getLogger("kvpilot.engine")


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, model_dir: str) -> None:
        self.config = config
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, model_cfg, self.device)
        torch.manual_seed(config.seed)
        self.kept_freed_memory = False
        if self.device.type == "cpu":
            if config.cpu_threads is not None:
                torch.set_num_threads(config.cpu_threads)
            self.kept_freed_memory = keep_freed_memory()
        self.block_size = config.block_size
        self.model_cfg = model_cfg
        self.vocab_size = model_cfg.vocab_size
        self.max_position_embeddings = model_cfg.max_position_embeddings
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.backend = resolve_backend(config.attention_backend, self.device)
        self.attention = PagedAttention(self.backend)
        # The C decode kernel reads float32 caches only: an fp8 cache decodes through SDPA.
        if (self.backend == "torch" and self.device.type == "cpu" and self.dtype == torch.float32
                and self.kv_cache_dtype == torch.float32):
            self.attention.use_decode_kernel(load_decode_kernel())
        self.model = LlamaForCausalLM.build(
            model_cfg, self.attention, model_cfg.max_position_embeddings, self.dtype, self.device,
        )
        # Before oneDNN packing: quantized layers are not nn.Linear, so they stay unpacked.
        if model_cfg.checkpoint_quantization is not None:
            self.quantization = load_quantized_checkpoint(self.model, iter_safetensors(model_dir),
                                                          model_cfg.checkpoint_quantization)
        else:
            self.model.load_weights(iter_safetensors(model_dir))
            self.quantization = (quantize_decoder(self.model, config.quantization)
                                 if config.quantization else None)
        self.weight_bytes = weight_bytes(self.model)
        spec = config.speculative_config
        self.draft: DraftModel | None = None
        if spec is not None and spec.method == "draft_model":
            # Its own attention: the torch backend's gather workspace has one cache layout.
            draft_attention = PagedAttention(self.backend)
            draft_attention.use_decode_kernel(self.attention.decode_kernel)
            self.draft = DraftModel(spec.model, model_cfg, config.max_model_len or self.max_position_embeddings,
                                    draft_attention, self.dtype, self.device, self.block_size,
                                    self.kv_cache_dtype)
            self.weight_bytes += self.draft.weight_bytes
        self.packed_linears = 0
        if packed_linear_available(self.dtype, self.device):
            self.packed_linears = pack_linears(self.model)
            if self.draft is not None:
                self.packed_linears += pack_linears(self.draft.model)
        self.sampler = Sampler()
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_tables = BlockTables()
        self.use_cuda_graphs = (self.device.type == "cuda" and self.backend == "triton"
                                and not config.enforce_eager)
        self.graphs: DecodeGraphs | None = None  # captured in allocate_kv_cache
        # Eager steps' metadata through pinned staging; the CPU uses the host tensors as they are.
        self.staging = StepStaging(self.device) if self.device.type != "cpu" else None

    def describe(self) -> str:
        linears = (f"; {self.packed_linears} linear layers through oneDNN" if self.packed_linears
                   else "")
        decode = ""
        if self.backend == "torch":
            kernel = self.attention.decode_kernel
            decode = f" (decode: C kernel {kernel.path.name})" if kernel else " (decode: SDPA)"
            if self.kv_cache_dtype == FP8:
                decode = " (decode: SDPA; the C kernel reads float32 caches, not fp8)"
        graphs = ""
        if self.graphs is not None:
            graphs = (f"; CUDA graphs for decode batches up to {self.graphs.sizes[-1]} "
                      f"(captured in {self.graphs.capture_seconds:.1f} s)")
        elif self.device.type == "cuda":
            graphs = "; eager (no CUDA graphs)"
        if self.quantization is not None:
            linears += f"; {self.quantization.describe()}"
        memory = "; freed memory kept in the process (mallopt)" if self.kept_freed_memory else ""
        if self.draft is not None:
            memory += (f"; draft model {self.config.speculative_config.model} "
                       f"({self.draft.weight_bytes / 2**20:.1f} MiB of weights)")
        if self.kv_cache_dtype != self.dtype:
            memory += f"; KV cache in {self.kv_cache_dtype} (per-layer K/V scales)"
        return (f"attention backend {self.backend}{decode}; {self.dtype} on {self.device}"
                f"{linears}{graphs}{memory}")

    def counters(self) -> dict[str, float]:
        return {}

    def release_loader_threads(self) -> None:
        # Two OpenMP pools (loader's and stepper's) on a small host cost ~20% of throughput.
        release_openmp_pool()

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def kv_cache_budget(self) -> int:
        if self.device.type == "cuda" and self.config.kv_cache_memory is None:
            total = torch.cuda.get_device_properties(self.device).total_memory
            peak = self.profile_peak_bytes(self.config.max_num_batched_tokens)
            return int(total * self.config.gpu_memory_utilization) - peak
        return self.config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY

    @property
    def kv_cache_element_bytes(self) -> int:
        return self.kv_cache_dtype.itemsize

    @property
    def kv_bytes_per_block(self) -> int:
        cfg = self.model_cfg
        elem = self.kv_cache_element_bytes
        target = 2 * cfg.num_hidden_layers * self.block_size * cfg.num_key_value_heads * cfg.head_dim * elem
        return target + (self.draft.kv_bytes_per_block if self.draft is not None else 0)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The cache's blocks; with CUDA graphs one more, the pad rows' scratch block (the
        block pool never sees it), then the graphs' capture."""
        cfg = self.model_cfg
        self.kv_caches = self._make_kv_caches(num_blocks + self.use_cuda_graphs)
        if self.draft is not None:
            self.draft.allocate_kv_cache(num_blocks)
        if self.use_cuda_graphs:
            self.graphs = DecodeGraphs(
                self.model, self.kv_caches, capture_sizes(self.config.max_num_seqs),
                self.config.max_model_len or self.max_position_embeddings, self.block_size,
                scratch_block=num_blocks, hidden_size=cfg.hidden_size, dtype=self.dtype,
                device=self.device)
            if self.device.type == "cuda":
                with torch.inference_mode():
                    self.graphs.capture()

    def _make_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.model_cfg
        shape = (num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        return [(torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
                 torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device))
                for _ in range(cfg.num_hidden_layers)]

    @torch.inference_mode()
    def profile_peak_bytes(self, num_tokens: int) -> int:
        """Peak CUDA memory of one forward over `num_tokens` prompt tokens (weights included)."""
        self.kv_caches = self._make_kv_caches(-(-num_tokens // self.block_size))
        torch.cuda.reset_peak_memory_stats(self.device)
        meta = _prefill_meta(num_tokens, self.block_size, self.device, self.backend)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        hidden = self.model(ids, torch.arange(num_tokens, device=self.device), self.kv_caches, meta)
        self.model.compute_logits(hidden[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_caches = []
        torch.cuda.empty_cache()
        return peak

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> StepResult:
        step = StepInputs.build(out, self.block_tables, self.block_size)
        if (self.graphs is not None and max(step.query_lens) == 1
                and self.graphs.fits(len(step.seq_lens), step.block_tables.shape[1])):
            hidden = self.graphs.run(DecodeRows(
                step.input_ids, step.positions, step.slot_mapping, step.block_tables,
                torch.tensor(step.seq_lens, dtype=torch.int32)))  # [num_seqs, hidden]
            return self._sample(step, hidden)
        hidden = self.forward(step, self.model, self.kv_caches)  # [num_tokens, hidden]
        return self._sample(step, hidden)

    def propose_drafts(self, requests: list[Request], num_drafts: list[int]) -> None:
        """The draft model's tokens for each request (speculative decoding, draft_model)."""
        self.draft.propose(requests, num_drafts, self.forward, self.block_tables)

    def forward(self, step: StepInputs, model: LlamaForCausalLM,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One eager forward pass of `model` (the target, or the draft through its own
        cache) over a step's inputs; the hidden states, [num_tokens, hidden]."""
        dev = self.device
        if self.staging is not None:
            staged = self.staging.upload(step.input_ids, step.positions, step.slot_mapping,
                                         step.block_tables, step.seq_lens, step.query_start_loc)
        else:
            staged = StagedStep(step.input_ids, step.positions, step.slot_mapping, step.block_tables,
                                torch.tensor(step.seq_lens, dtype=torch.int32), step.query_start_loc)
        meta = AttentionMetadata(
            slot_mapping=staged.slot_mapping, block_tables=staged.block_tables,
            seq_lens=staged.seq_lens, query_start_loc=staged.query_start_loc,
            max_query_len=max(step.query_lens),
            max_seq_len=max(step.seq_lens),
            seq_lens_cpu=step.seq_lens,
            query_lens_cpu=step.query_lens,
            torch_plan=None if self.backend != "torch" else plan_torch_attention(
                step.block_tables, step.seq_lens, step.query_lens, self.block_size, dev,
                decode_kernel=self.attention.decode_kernel is not None),
        )
        return model(staged.input_ids, staged.positions, kv_caches, meta)

    def _sample(self, step: StepInputs, hidden: torch.Tensor) -> StepResult:
        dev = self.device
        if not step.sample_rows:
            return StepResult([], [])
        if step.spec_drafts:
            return verify_step(self.model.compute_logits, hidden, step.sample_rows, step.sample_requests,
                               step.spec_drafts, self.sampler, dev)
        logits = self.model.compute_logits(hidden[torch.tensor(step.sample_rows, device=dev)])
        batch = SamplingBatch.build(step.sample_requests, logits.shape[-1], dev)
        sampled = self.sampler(logits, batch)
        return StepResult(step.sample_requests, [[t] for t in sampled.token_ids.tolist()],
                          _host_logprobs(sampled))


def _host_logprobs(s: SamplerOutput) -> list[list[TokenLogprob]] | None:
    """One host copy of the step's logprob tensors, one row per sampled request."""
    if s.logprob is None:
        return None
    chosen, ids, lps = s.logprob.tolist(), s.top_ids.tolist(), s.top_logprobs.tolist()
    return [[TokenLogprob(t, chosen[i], list(zip(ids[i], lps[i])))]
            for i, t in enumerate(s.token_ids.tolist())]


def _prefill_meta(num_tokens: int, block_size: int, device: torch.device,
                  backend: str) -> AttentionMetadata:
    num_blocks = -(-num_tokens // block_size)
    tables = torch.arange(num_blocks, dtype=torch.int32)[None, :]  # [1, num_blocks]
    return AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        max_query_len=num_tokens, max_seq_len=num_tokens,
        seq_lens_cpu=[num_tokens], query_lens_cpu=[num_tokens],
        torch_plan=None if backend != "torch" else plan_torch_attention(
            tables, [num_tokens], [num_tokens], block_size, device),
    )
