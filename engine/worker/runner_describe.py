"""The start-up line of the real executor: backend, dtype, device and what is special."""

from __future__ import annotations

import torch

from kvpilot.kernels.kv_cache_dtype import FP8


def describe_runner(self) -> str:
    """The start-up log line's account of how the model runs (`ModelRunner.describe`)."""
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
    ranks = ""
    if self.group is not None:
        lay = self.group.layout
        ranks = (f"; {lay.world_size} ranks (tensor parallel {lay.tp_size} x pipeline "
                 f"{lay.pp_size}, {self.group.transport}), {torch.get_num_threads()} threads each")
    return (f"attention backend {self.backend}{decode}; {self.dtype} on {self.device}"
            f"{linears}{graphs}{memory}{ranks}")

