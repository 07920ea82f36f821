"""Collectives between ranks on one host through shared memory, for the CPU.

gloo's TCP transport costs about 2 ms per collective on the 2-core development VM whatever
the size (measured: a [1, 256] all-reduce 2.3 ms, a small broadcast 2.2 ms), and a tensor-
parallel decode step needs two all-reduces per layer. Here each rank writes its tensor into
its own slot of a shared file in /dev/shm, raises its flag, and waits until every rank's
flag shows the same operation; then each reads the slots (all-reduce: adds them in rank
order, so every rank gets the same bits). Two sets of slots alternate, so a rank may start
the next operation while a slower one still reads the last. Waits spin briefly, then
sleep in growing steps (an idle worker costs no CPU). x86-64 only: its stores are seen in
program order (the data before the flag); elsewhere the group keeps gloo.

What does not fit a slot goes through gloo; every rank decides the same way (sizes are
the same on every rank, and a broadcast's header says so)."""

from __future__ import annotations

import mmap
import os
import pickle
import platform
import struct
import time
from typing import Callable

import numpy as np
import torch

FLAG_STRIDE = 8  # int64s per flag: one cache line each, so ranks' flags never share one
# Busy-wait this long before sleeping: peers inside the same step answer within the first;
# between steps rank 0 schedules and samples for a millisecond or two, so a worker waiting
# for the next step spins through that too (unless ranks outnumber cores: then never spin).
TENSOR_SPIN_S = 0.002
CONTROL_SPIN_S = 0.010
MAX_SLEEP_S = 0.005  # then sleep up to this between looks (an idle server's workers)
HEADER = struct.Struct("<q")  # a broadcast's payload length, or -1: sent through gloo


def available() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


class ShmChannel:
    def __init__(self, path: str, rank: int, size: int, slot_bytes: int, create: bool,
                 spin_s: float = TENSOR_SPIN_S) -> None:
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        self.spin_s = spin_s
        flag_bytes = 2 * size * FLAG_STRIDE * 8
        total = flag_bytes + 2 * size * slot_bytes
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, total)  # ENOSPC now, not SIGBUS on first touch
            self.mm = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        self.flags = np.frombuffer(self.mm, dtype=np.int64, count=2 * size * FLAG_STRIDE).reshape(
            2, size, FLAG_STRIDE)  # [parity, rank, stride]
        self.data = torch.frombuffer(self.mm, dtype=torch.uint8, offset=flag_bytes).view(
            2, size, slot_bytes)  # [parity, rank, slot_bytes]
        self.seq = 0

    def _arrive(self, write: Callable[[torch.Tensor], None], alive: Callable[[], bool],
                deadline_s: float | None) -> int:
        """Write this rank's slot (via `write`), raise the flag, wait for every rank's; the
        parity whose slots now hold this operation's data."""
        self.seq += 1
        parity = self.seq & 1
        write(self.data[parity, self.rank])
        self.flags[parity, self.rank, 0] = self.seq
        flags = self.flags[parity, :, 0]
        start = time.monotonic()
        sleep = 0.00005
        while flags.min() < self.seq:
            waited = time.monotonic() - start
            if waited < self.spin_s:
                continue
            if not alive():
                raise RuntimeError("a rank left the shared-memory channel (its process is gone)")
            if deadline_s is not None and waited > deadline_s:
                raise RuntimeError(f"a rank did not reach the collective within {deadline_s:g} s")
            time.sleep(sleep)
            sleep = min(sleep * 2, MAX_SLEEP_S)
        return parity

    def all_reduce(self, x: torch.Tensor, alive, deadline_s: float) -> bool:
        """Sum `x` over the ranks in place; False (nothing done) when it does not fit a slot."""
        nbytes = x.numel() * x.element_size()
        if nbytes > self.slot_bytes or not x.is_contiguous():  # the sum is written back through a view
            return False
        flat = x.view(-1)
        parity = self._arrive(lambda slot: slot[:nbytes].view(x.dtype).copy_(flat), alive, deadline_s)
        parts = [self.data[parity, r, :nbytes].view(x.dtype) for r in range(self.size)]
        if x.dtype == torch.float32:
            total = parts[0].clone()
            for p in parts[1:]:
                total.add_(p)
        else:  # 16-bit activations add in float32, as NCCL and gloo do not, but as they should
            total = parts[0].float()
            for p in parts[1:]:
                total.add_(p.float())
        flat.copy_(total)
        return True

    def all_gather(self, x: torch.Tensor, alive, deadline_s: float) -> list[torch.Tensor] | None:
        """Every rank's `x` (same shape everywhere), by rank; None when it does not fit."""
        nbytes = x.numel() * x.element_size()
        if nbytes > self.slot_bytes:
            return None
        flat = x.contiguous().reshape(-1)
        parity = self._arrive(lambda slot: slot[:nbytes].view(x.dtype).copy_(flat), alive, deadline_s)
        return [self.data[parity, r, :nbytes].view(x.dtype).view(x.shape).clone() for r in range(self.size)]

    def broadcast(self, obj, alive) -> tuple[bool, object]:
        """Rank 0's `obj` on every rank: (True, obj), or (False, None) when rank 0's payload
        did not fit and every rank must take it through gloo. No deadline: workers wait here
        for as long as the server idles."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == 0 else b""
        fits = len(payload) + HEADER.size <= self.slot_bytes

        def write(slot: torch.Tensor) -> None:
            if self.rank != 0:
                return
            head = HEADER.pack(len(payload) if fits else -1)
            body = head + payload if fits else head
            slot[:len(body)].copy_(torch.frombuffer(bytearray(body), dtype=torch.uint8))

        parity = self._arrive(write, alive, None)
        slot = self.data[parity, 0]
        (length,) = HEADER.unpack(bytes(slot[:HEADER.size].numpy()))
        if length < 0:
            return False, None
        if self.rank == 0:
            return True, obj
        return True, pickle.loads(slot[HEADER.size:HEADER.size + length].numpy().tobytes())

    def close(self) -> None:
        del self.flags, self.data
        try:
            self.mm.close()
        except BufferError:  # a tensor view still alive: the mapping goes with the process
            pass
