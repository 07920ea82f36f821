"""One process's view of the engine's ranks: its tensor-parallel group and the collectives
the sharded model and the step protocol use.

Ranks are laid out stage-major: world rank = stage * tp_size + tp_rank. Collectives inside a
stage (the all-reduces of row-parallel layers, the LM head's gather) use the stage's tensor
group; rank 0 sends each step's inputs over a gloo group of all ranks (on CUDA the tensor
groups are NCCL, and control messages stay on the CPU, as vLLM keeps a gloo "cpu group")."""

from __future__ import annotations

import datetime
import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import shm_channel
from .shm_channel import ShmChannel

log = logging.getLogger("kvpilot.engine")

# A peer that stops answering (hung, not dead: a dead one closes its sockets and the
# collective fails at once) fails a collective after this long.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
# Workers wait for rank 0's next message for as long as the server idles; a driver that
# dies closes its sockets (and its workers die with it: PR_SET_PDEATHSIG), so no timeout.
CONTROL_TIMEOUT = datetime.timedelta(days=365)
CONTROL_SLOT_BYTES = 4 << 20  # a step's inputs, pickled; larger ones go through gloo
MAX_TENSOR_SLOT_BYTES = 32 << 20


@dataclass(frozen=True)
class Layout:
    """Where one rank sits: tensor_parallel_size x pipeline_parallel_size ranks."""

    rank: int
    tp_size: int
    pp_size: int

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp_size - 1

    def rank_of(self, stage: int, tp_rank: int | None = None) -> int:
        return stage * self.tp_size + (self.tp_rank if tp_rank is None else tp_rank)


class ParallelGroup:
    """Collectives for one rank. Made once per process by `join`."""

    def __init__(self, layout: Layout, device: torch.device, tensor_slot_bytes: int = 0) -> None:
        self.layout = layout
        self.device = device
        # Whether the other ranks are still there (set by the owner: rank 0's watcher).
        self.alive: Callable[[], bool] = lambda: True
        self.control: ShmChannel | None = None  # CPU ranks on one host: shared memory
        self.tensor: ShmChannel | None = None
        self.cpu_group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        # Every process must create every group, in the same order, even those it is not in.
        self.tp_group = None
        for stage in range(layout.pp_size):
            ranks = [layout.rank_of(stage, r) for r in range(layout.tp_size)]
            group = dist.new_group(ranks, timeout=COLLECTIVE_TIMEOUT)
            if stage == layout.stage:
                self.tp_group = group
        # KVPILOT_PARALLEL_SHM=0 keeps gloo for everything (to compare; the workers inherit it).
        if (device.type == "cpu" and tensor_slot_bytes and layout.world_size > 1 and shm_channel.available()
                and os.environ.get("KVPILOT_PARALLEL_SHM", "1") != "0"):
            self._open_shared_memory(tensor_slot_bytes)

    def _open_shared_memory(self, tensor_slot_bytes: int) -> None:
        """Rank 0 makes the files (one for control, one per stage's tensor group), every
        rank maps them, then rank 0 unlinks them: nothing is left behind whatever happens
        next. Any failure (no room in /dev/shm) leaves every rank on gloo."""
        lay = self.layout
        paths = None
        if lay.rank == 0:
            base = f"/dev/shm/kvpilot-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                ShmChannel(f"{base}-control", 0, lay.world_size, CONTROL_SLOT_BYTES, create=True).close()
                for stage in range(lay.pp_size if lay.tp_size > 1 else 0):
                    ShmChannel(f"{base}-tp{stage}", 0, lay.tp_size, tensor_slot_bytes, create=True).close()
                paths = base
            except OSError as exc:
                log.warning("shared memory for the ranks' collectives: %s; using gloo (slower)", exc)
                self._unlink(base)
        box = [paths]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        if box[0] is None:
            return
        base = box[0]
        # Spinning ranks that outnumber the cores would take turns spinning, not computing.
        spin = lay.world_size <= (os.cpu_count() or 1)
        self.control = ShmChannel(f"{base}-control", lay.rank, lay.world_size, CONTROL_SLOT_BYTES, create=False,
                                  spin_s=shm_channel.CONTROL_SPIN_S if spin else 0.0)
        if lay.tp_size > 1:
            self.tensor = ShmChannel(f"{base}-tp{lay.stage}", lay.tp_rank, lay.tp_size, tensor_slot_bytes,
                                     create=False, spin_s=shm_channel.TENSOR_SPIN_S if spin else 0.0)
        dist.barrier(group=self.cpu_group)
        if lay.rank == 0:
            self._unlink(base)

    def _unlink(self, base: str) -> None:
        for suffix in ["-control"] + [f"-tp{s}" for s in range(self.layout.pp_size)]:
            try:
                os.unlink(base + suffix)
            except FileNotFoundError:
                pass

    @classmethod
    def join(cls, layout: Layout, init_method: str, device: torch.device,
             tensor_slot_bytes: int = 0) -> ParallelGroup:
        """Join the engine's process group (blocks until every rank has). On the CPU the
        collectives go through shared memory with slots of `tensor_slot_bytes` (0: gloo)."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=init_method, rank=layout.rank,
                                world_size=layout.world_size, timeout=COLLECTIVE_TIMEOUT)
        return cls(layout, device, tensor_slot_bytes)

    @property
    def transport(self) -> str:
        """How this rank's collectives travel, for the start-up line."""
        if self.device.type == "cuda":
            return "nccl"
        return "shared memory" if self.control is not None else "gloo"

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the stage's tensor-parallel ranks, in place."""
        if self.tp_size > 1:
            if self.tensor is None or not self.tensor.all_reduce(x, self.alive, COLLECTIVE_TIMEOUT.total_seconds()):
                dist.all_reduce(x, group=self.tp_group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every tensor rank's `x` side by side along the last dimension (equal shapes)."""
        if self.tp_size == 1:
            return x
        parts = None
        if self.tensor is not None:
            parts = self.tensor.all_gather(x, self.alive, COLLECTIVE_TIMEOUT.total_seconds())
        if parts is None:
            parts = [torch.empty_like(x) for _ in range(self.tp_size)]
            dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (pickled once, sent over the CPU group)."""
        if self.control is not None:
            done, value = self.control.broadcast(obj, self.alive)
            if done:
                return value
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def all_reduce_min(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def gather_to_driver(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, by rank, on rank 0; None elsewhere."""
        out = [None] * self.layout.world_size if self.layout.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.cpu_group)
        return out

    def send(self, x: torch.Tensor, dst: int) -> dist.Work:
        return dist.isend(x.contiguous(), dst)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(out, src)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.cpu_group)

    def close(self) -> None:
        for channel in (self.control, self.tensor):
            if channel is not None:
                channel.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port() -> int:
    """A TCP port on the loopback nobody listens on now (the rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tensor_slot_bytes(config, model_cfg) -> int:
    """A shared-memory slot for one step's largest all-reduce ([tokens, hidden]) or logits
    gather ([rows, vocab / tp] float32), capped; larger ones (a raised max_num_seqs) take gloo."""
    tokens = config.max_num_batched_tokens
    spec = config.speculative_config
    rows = min(tokens, config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0)))
    activations = tokens * model_cfg.hidden_size * 4
    logits = rows * -(-model_cfg.vocab_size // config.tensor_parallel_size) * 4
    return min(max(activations, logits), MAX_TENSOR_SLOT_BYTES)


def cpu_threads_per_rank(world_size: int, configured: int | None) -> int:
    """Each rank's share of the host's cores, unless --cpu-threads says otherwise: ranks
    on one host must not oversubscribe it (two OpenMP pools on a core cost more than one)."""
    if configured is not None:
        return configured
    return max(1, (os.cpu_count() or 1) // world_size)
