"""Reads one rank's slices of a safetensors checkpoint, and only those bytes.

The format is an 8-byte little-endian header length, a JSON header (each tensor's dtype,
shape and byte range) and the tensors' bytes, row-major. A slice along dimension 0 is one
contiguous range: one pread. A slice along dimension 1 is one range per row. Reading with
pread (not mmap) makes the bytes read exact and visible in /proc/self/io, so a rank's
loading cost can be measured (`bytes_read`)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from ..config.model import ModelConfig
from .weights import safetensors_files
from ..parallel.sharding import ModelShard

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
          "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "F64": torch.float64}


class SafetensorsFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        (length,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
        self.bytes_read = 8 + length
        header = json.loads(os.pread(self.fd, length, 8))
        header.pop("__metadata__", None)
        self.data_start = 8 + length
        self.tensors = header

    def close(self) -> None:
        os.close(self.fd)

    def read(self, name: str, cut: tuple[int, int, int] | None) -> torch.Tensor:
        """The tensor, or its slice (dimension, start, length) padded with zeros where
        it runs past the end of dimension 0."""
        info = self.tensors[name]
        if info["dtype"] not in DTYPES:
            raise ValueError(f"model: {self.path.name}: tensor {name!r} has dtype {info['dtype']}, "
                             f"which the sharded loader does not read")
        dtype, shape = DTYPES[info["dtype"]], list(info["shape"])
        begin = self.data_start + info["data_offsets"][0]
        item = dtype.itemsize
        if cut is None:
            dim, start, length = 0, 0, shape[0] if shape else 1
        else:
            dim, start, length = cut
        if dim == 0:
            row = item * (_numel(shape[1:]))
            have = max(0, min(length, shape[0] - start)) if shape else 1
            data = self._pread(begin + start * row, have * row)
            out = torch.zeros([length] + shape[1:], dtype=dtype) if have < length else None
            part = torch.frombuffer(data, dtype=dtype).reshape([have] + shape[1:]) if have else None
            if out is None:
                return part if shape else part.reshape([])
            if have:
                out[:have] = part
            return out
        if dim != 1 or len(shape) != 2:
            raise ValueError(f"model: tensor {name!r}: cannot slice dimension {dim} of shape {shape}")
        rows, cols = shape
        width = length * item
        data = bytearray(rows * width)
        view = memoryview(data)
        for r in range(rows):  # one range per row
            n = os.preadv(self.fd, [view[r * width:(r + 1) * width]], begin + (r * cols + start) * item)
            if n != width:
                raise ValueError(f"model: {self.path.name} ends inside tensor {name!r}")
        self.bytes_read += rows * width
        return torch.frombuffer(data, dtype=dtype).reshape(rows, length)

    def _pread(self, offset: int, size: int) -> bytearray:
        data = bytearray(size)
        if size and os.preadv(self.fd, [data], offset) != size:
            raise ValueError(f"model: {self.path.name} ends inside a tensor")
        self.bytes_read += size
        return data


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class ShardedCheckpoint:
    """Yields (this rank's parameter name, its slice) for every tensor the rank holds."""

    def __init__(self, model_dir: str | Path, cfg: ModelConfig, shard: ModelShard) -> None:
        self.files = [SafetensorsFile(p) for p in safetensors_files(model_dir)]
        self.cfg, self.shard = cfg, shard

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self.files)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        wanted = [(f, name) for f in self.files for name in f.tensors]
        try:
            with tqdm(total=len(wanted), desc="Loading weights (sharded)", unit="tensor",
                      disable=None) as bar:
                for f, name in wanted:
                    local = self.shard.local_name(name, self.cfg)
                    if local is not None and "rotary_emb.inv_freq" not in name:
                        shape = tuple(f.tensors[name]["shape"])
                        yield local, f.read(name, self.shard.slice_of(name, shape))
                    bar.update(1)
        finally:
            for f in self.files:
                f.close()
