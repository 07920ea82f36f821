"""Loads the model, owns the paged KV cache, and runs one scheduled step."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .attention import PagedAttention, resolve_backend
from .attention_metadata import AttentionMetadata
from .config import EngineConfig
from .model_config import ModelConfig
from .models.llama import LlamaForCausalLM
from .sampler import Sampler, SamplerOutput, SamplingBatch
from .scheduler import SchedulerOutput
from .weights import iter_safetensors

log = logging.getLogger("kvpilot.engine")


@dataclass
class StepResult:
    request_ids: list[str]  # rows of `sampled`, in order
    sampled: SamplerOutput


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model_cfg: ModelConfig, model_dir: str,
        device: torch.device, dtype: torch.dtype, max_model_len: int,
    ) -> None:
        self.device, self.dtype = device, dtype
        self.block_size = config.block_size
        self.model_cfg = model_cfg
        self.backend = resolve_backend(config.attention_backend, device)
        max_positions = max(max_model_len, model_cfg.max_position_embeddings)
        self.model = LlamaForCausalLM.build(
            model_cfg, PagedAttention(self.backend), max_positions, dtype, device
        )
        self.model.load_weights(iter_safetensors(model_dir))
        self.sampler = Sampler()
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def kv_bytes_per_block(self) -> int:
        cfg = self.model_cfg
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * cfg.num_hidden_layers * self.block_size * cfg.num_key_value_heads * cfg.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg = self.model_cfg
        shape = (num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(cfg.num_hidden_layers)
        ]

    @torch.inference_mode()
    def profile_peak_bytes(self, num_tokens: int) -> int:
        """Peak CUDA memory of one forward over `num_tokens` prompt tokens (weights included)."""
        self.allocate_kv_cache(-(-num_tokens // self.block_size))
        torch.cuda.reset_peak_memory_stats(self.device)
        meta = _prefill_meta(num_tokens, self.block_size, self.device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        hidden = self.model(ids, torch.arange(num_tokens, device=self.device), self.kv_caches, meta)
        self.model.compute_logits(hidden[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_caches = []
        torch.cuda.empty_cache()
        return peak

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, block_tables: list[list[int]]) -> StepResult:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        sample_rows: list[int] = []
        sample_requests = []
        for item, table in zip(out.scheduled, block_tables):
            req = item.request
            start = req.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(req.token_at(start, end))
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            query_lens.append(item.num_new_tokens)
            if item.samples:
                sample_rows.append(len(input_ids) - 1)
                sample_requests.append(req)
        dev = self.device
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True),
            block_tables=tables.to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32).to(dev, non_blocking=True),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            seq_lens_cpu=seq_lens,
            query_lens_cpu=query_lens,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long).to(dev, non_blocking=True),
            torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True),
            self.kv_caches, meta,
        )  # [num_tokens, hidden]
        if not sample_rows:
            return StepResult([], SamplerOutput(token_ids=torch.empty(0, dtype=torch.long)))
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
        batch = SamplingBatch.build(sample_requests, logits.shape[-1], dev)
        return StepResult([r.request_id for r in sample_requests], self.sampler(logits, batch))


def _prefill_meta(num_tokens: int, block_size: int, device: torch.device) -> AttentionMetadata:
    num_blocks = -(-num_tokens // block_size)
    return AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :],
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        max_query_len=num_tokens, max_seq_len=num_tokens,
        seq_lens_cpu=[num_tokens], query_lens_cpu=[num_tokens],
    )
