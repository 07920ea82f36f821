"""The draft model of speculative decoding: a small model with the target's tokenizer,
run by the same executor, proposing K tokens per request after each step.

Its paged KV cache has the target's block layout: the same block ids index a second set of
per-layer tensors, so the target's block tables, slot mapping and prefix cache serve both
and the KV cache manager allocates for both at once (a block costs the target's bytes
plus the draft's). A request's draft KV is valid for its first `spec.draft_num_computed`
tokens; that count chases the target's computed tokens (clamped back after a rejection,
a preemption or a rollback), so the draft catches up on what it has not seen (a prompt,
a prefix-cache hit, the last step's accepted tokens) in its first pass, then runs K - 1
single-token passes."""

from __future__ import annotations

import torch

from ..attention.layer import PagedAttention
from ..config.model import ModelConfig
from ..models.llama import LlamaForCausalLM
from ..loader.source import resolve_model
from ..core.request import Request
from ..sample.sampler import Sampler, SamplingBatch, processed_probs
from .step_inputs import StepInputs
from ..loader.weights import iter_safetensors

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class DraftModel:
    def __init__(self, source: str, target: ModelConfig, max_model_len: int, attention: PagedAttention,
                 dtype: torch.dtype, device: torch.device, block_size: int,
                 kv_cache_dtype: torch.dtype | None = None) -> None:
        model_dir = resolve_model(source)
        cfg = ModelConfig.from_dir(model_dir)
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary ({cfg.vocab_size}) differs from "
                             f"the target's ({target.vocab_size}); a draft needs the target's tokenizer")
        if cfg.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config.model: the draft has {cfg.max_position_embeddings} positions, "
                             f"fewer than max_model_len ({max_model_len})")
        self.cfg, self.dtype, self.device, self.block_size = cfg, dtype, device, block_size
        # Its cache follows --kv-cache-dtype (a block's draft share halves under fp8 too, as in
        # vLLM): the target verifies every proposal, so the draft's KV precision moves the
        # acceptance rate, never the outputs. Its layers keep their own K/V scales (1.0).
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.model = LlamaForCausalLM.build(cfg, attention, cfg.max_position_embeddings, dtype, device)
        self.model.load_weights(iter_safetensors(model_dir))
        # Stays float under --quantization (which quantizes the target only): it is small, and
        # the target verifies its proposals, so its precision moves speed, not outputs' distribution.
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.kv_caches: KVCaches = []
        self.sampler = Sampler()

    @property
    def kv_bytes_per_block(self) -> int:
        cfg = self.cfg
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return 2 * cfg.num_hidden_layers * self.block_size * cfg.num_key_value_heads * cfg.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (num_blocks, self.block_size, self.cfg.num_key_value_heads, self.cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
                           torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device))
                          for _ in range(self.cfg.num_hidden_layers)]

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_drafts: list[int], forward, tables) -> None:
        """Set each request's `spec.token_ids` (num_drafts[i] of them, their slots already
        allocated) and, for sampled requests, `spec.draft_probs` ([K', vocab]: the
        distributions they were drawn from, which verification needs). `forward(step,
        model, kv_caches)` is the executor's eager forward pass; `tables` its block tables."""
        rows = []
        for req in requests:
            start = min(req.spec.draft_num_computed, req.num_computed_tokens)
            rows.append((req, start, req.token_at(start, req.num_tokens)))
            req.spec.token_ids, req.spec.draft_probs = [], None
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        live = list(range(len(requests)))
        while live:
            step = StepInputs.for_rows([rows[i] for i in live], tables, self.block_size)
            hidden = forward(step, self.model, self.kv_caches)  # [num_tokens, hidden]
            logits = self.model.compute_logits(hidden[torch.tensor(step.sample_rows, device=self.device)])
            batch = SamplingBatch.build([requests[i] for i in live], logits.shape[-1], self.device)
            tokens = self.sampler(logits, batch).token_ids.tolist()
            dist = None if batch.all_greedy else processed_probs(logits, batch)  # [B, vocab]
            still = []
            for j, i in enumerate(live):
                req, start, fed = rows[i]
                drafts[i].append(tokens[j])
                if dist is not None and not req.sampling_params.greedy:
                    probs[i].append(dist[j] / dist[j].sum())
                req.spec.draft_num_computed = start + len(fed)
                if len(drafts[i]) < num_drafts[i]:  # feed the draft its own token next
                    rows[i] = (req, start + len(fed), [tokens[j]])
                    still.append(i)
            live = still
        for i, req in enumerate(requests):
            req.spec.token_ids = drafts[i]
            if probs[i]:
                req.spec.draft_probs = torch.stack(probs[i])  # [K', vocab]
