"""The real executor: loads the model in torch, owns the paged KV cache, runs one step."""

from __future__ import annotations

import logging
import torch

from ..attention.layer import PagedAttention, resolve_backend
from ..attention.metadata import AttentionMetadata
from ..config.engine import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig
from ..attention.cpu import plan_torch_attention
from ..attention.cpu_decode_kernel import load_decode_kernel
from .cuda_graphs import DecodeGraphs, DecodeRows, capture_sizes
from .cpu_linear import pack_linears, packed_linear_available
from .cpu_malloc import keep_freed_memory
from .cpu_threads import release_openmp_pool
from .device import pick_device, pick_dtype
from .draft_model import DraftModel
from ..core.executor import StepResult
from kvpilot.kernels.kv_cache_dtype import resolve_kv_cache_dtype
from ..config.model import ModelConfig
from ..models.llama import LlamaForCausalLM
from ..core.outputs import TokenLogprob
from ..parallel.group import ParallelGroup, cpu_threads_per_rank
from ..loader.sharded_reader import ShardedCheckpoint
from ..parallel.sharding import ModelShard
from ..quant.checkpoint_load import load_quantized_checkpoint
from ..quant.quantize import quantize_decoder, weight_bytes
from ..core.request import Request
from .runner_describe import describe_runner
from ..sample.sampler import Sampler, SamplerOutput, SamplingBatch
from ..core.scheduler import SchedulerOutput
from ..spec_decode.verify import verify_step
from .step_inputs import BlockTables, StepInputs
from .step_staging import StagedStep, StepStaging
from ..loader.weights import iter_safetensors

log = logging.getLogger("kvpilot.engine")


class ModelRunner:
    """The whole model in this process, or with `group` (tensor/pipeline parallelism) this
    rank's shard of it: rank 0 (the driver's) also samples and runs any draft model."""

    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, model_dir: str,
                 group: ParallelGroup | None = None) -> None:
        self.config = config
        self.group = group
        self.device = group.device if group is not None else pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, model_cfg, self.device)
        torch.manual_seed(config.seed)
        self.kept_freed_memory = False
        if self.device.type == "cpu":
            threads = (config.cpu_threads if group is None
                       else cpu_threads_per_rank(config.world_size, config.cpu_threads))
            if threads is not None:
                torch.set_num_threads(threads)
            self.kept_freed_memory = keep_freed_memory()
        lay = group.layout if group is not None else None
        self.shard = (ModelShard() if lay is None
                      else ModelShard.plan(model_cfg, lay.tp_size, lay.tp_rank, lay.pp_size, lay.stage))
        self.is_driver = lay is None or lay.rank == 0
        self.workers = None  # rank 0 of several: the other ranks' processes (parallel/workers.py)
        self.pipeline_idle_seconds = 0.0  # waiting for another stage (pipeline parallelism)
        self.parallel_step_seconds = 0.0  # in this rank's part of steps, waits included
        self.rank_reports: list[dict] = []  # rank 0 of several: every rank's rank_report() at start
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
            self.shard, group,
        )
        self.load_bytes_read: int | None = None  # a sharded load's bytes read from the checkpoint
        # Before oneDNN packing: quantized layers are not nn.Linear, so they stay unpacked.
        if model_cfg.checkpoint_quantization is not None:
            self.quantization = load_quantized_checkpoint(self.model, iter_safetensors(model_dir),
                                                          model_cfg.checkpoint_quantization)
        elif group is not None:
            checkpoint = ShardedCheckpoint(model_dir, model_cfg, self.shard)
            self.model.load_weights(checkpoint)
            self.load_bytes_read = checkpoint.bytes_read
            self.quantization = None
        else:
            self.model.load_weights(iter_safetensors(model_dir))
            self.quantization = (quantize_decoder(self.model, config.quantization)
                                 if config.quantization else None)
        self.weight_bytes = self.rank_weight_bytes = weight_bytes(self.model)  # before oneDNN packing
        spec = config.speculative_config
        self.draft: DraftModel | None = None
        if spec is not None and spec.method == "draft_model" and self.is_driver:
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
        # Not with several ranks yet: a graph would have to capture the collectives too.
        self.use_cuda_graphs = (self.device.type == "cuda" and self.backend == "triton"
                                and not config.enforce_eager and group is None)
        self.graphs: DecodeGraphs | None = None  # captured in allocate_kv_cache
        # Eager steps' metadata through pinned staging; the CPU uses the host tensors as they are.
        self.staging = StepStaging(self.device) if self.device.type != "cpu" else None

    def describe(self) -> str:
        return describe_runner(self)

    def counters(self) -> dict[str, float]:
        return {}

    def rank_report(self) -> dict:
        """What this rank holds and did, for rank 0's log, metrics and tests."""
        return {"rank": 0 if self.group is None else self.group.layout.rank,
                "layers": self.shard.num_layers(self.model_cfg),
                "kv_heads": self.model_cfg.num_key_value_heads // self.shard.tp_size,
                "weight_bytes": self.rank_weight_bytes,
                "load_bytes_read": self.load_bytes_read,
                "pipeline_idle_seconds": self.pipeline_idle_seconds,
                "parallel_step_seconds": self.parallel_step_seconds}

    def failure(self) -> str | None:
        """Why the engine cannot run (a rank died), or None."""
        return None if self.workers is None else self.workers.failure

    def shutdown(self) -> None:
        """Stop the other ranks' processes (nothing to do with one)."""
        if self.workers is not None:
            self.workers.shutdown()

    def release_loader_threads(self) -> None:
        # Two OpenMP pools (loader's and stepper's) on a small host cost ~20% of throughput.
        release_openmp_pool()

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def kv_cache_budget(self) -> int:
        """The engine's KV bytes, every rank's together (a CPU budget is the engine's)."""
        if self.device.type == "cuda" and self.config.kv_cache_memory is None:
            if self.workers is not None:
                return self.workers.kv_cache_budget(self)
            return self.rank_kv_cache_budget()
        return self.config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY

    def rank_kv_cache_budget(self) -> int:
        """This GPU's memory left for KV after weights and a full-budget forward's peak."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        peak = self.profile_peak_bytes(self.config.max_num_batched_tokens)
        return int(total * self.config.gpu_memory_utilization) - peak

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
        if self.workers is not None:
            self.workers.allocate_kv_cache(num_blocks)
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
        """This rank's layers and KV heads of every block."""
        cfg = self.model_cfg
        shape = (num_blocks, self.block_size, cfg.num_key_value_heads // self.shard.tp_size, cfg.head_dim)
        return [(torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
                 torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device))
                for _ in range(self.shard.num_layers(cfg))]

    @torch.inference_mode()
    def profile_peak_bytes(self, num_tokens: int) -> int:
        """Peak CUDA memory of one forward over `num_tokens` prompt tokens (weights included)."""
        self.kv_caches = self._make_kv_caches(-(-num_tokens // self.block_size))
        torch.cuda.reset_peak_memory_stats(self.device)
        if self.group is not None:  # every rank's part, through the pipeline
            from .parallel_step import run_parallel_step

            run_parallel_step(self, StepInputs.profile(num_tokens, self.block_size))
        else:
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
        if self.workers is not None:
            # Every rank runs its part; the logits come back to this one, to sample.
            return self._sample(step, self.workers.run_step(self, step))
        rows = step.logit_rows()
        if (self.graphs is not None and max(step.query_lens) == 1
                and self.graphs.fits(len(step.seq_lens), step.block_tables.shape[1])):
            hidden = self.graphs.run(DecodeRows(
                step.input_ids, step.positions, step.slot_mapping, step.block_tables,
                torch.tensor(step.seq_lens, dtype=torch.int32)))  # [num_seqs, hidden]
        else:
            hidden = self.forward(step, self.model, self.kv_caches)  # [num_tokens, hidden]
        if not rows:
            return self._sample(step, None)
        return self._sample(step, self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]))

    def propose_drafts(self, requests: list[Request], num_drafts: list[int]) -> None:
        """The draft model's tokens for each request (speculative decoding, draft_model)."""
        self.draft.propose(requests, num_drafts, self.forward, self.block_tables)

    def forward(self, step: StepInputs, model: LlamaForCausalLM,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                hidden: torch.Tensor | None = None) -> torch.Tensor:
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
        return model(staged.input_ids, staged.positions, kv_caches, meta, hidden)

    def _sample(self, step: StepInputs, logits: torch.Tensor | None) -> StepResult:
        """Sample from the logits of `step.logit_rows()` ([rows, vocab] float32)."""
        dev = self.device
        if not step.sample_rows:
            return StepResult([], [])
        if step.spec_drafts:
            index = {row: i for i, row in enumerate(step.logit_rows())}
            return verify_step(lambda rows: logits[torch.tensor([index[r] for r in rows], device=dev)],
                               step.sample_rows, step.sample_requests, step.spec_drafts, self.sampler, dev)
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
