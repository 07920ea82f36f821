"""The CPU decode-attention kernel (csrc/paged_decode_attention.c): built once per host
with its C compiler, loaded with ctypes, checked against the SDPA path it replaces.

Built with -march=native, so the library is cached per source, compiler and CPU
(under $KVPILOT_CACHE_DIR/kernels). Where no compiler works (the container image has
none), `load_decode_kernel` returns None and the torch backend keeps its SDPA decode;
`describe` says which one runs. Float32 only; other dtypes use SDPA.

Tolerance against the reference (kernels/_reference.py, float32): 1e-5 absolute and
relative (tests/engine/attention/test_cpu_attention.py); only the summation order differs."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch  # first: the kernel then binds to torch's OpenMP runtime (libgomp.so.1)

from ..config.cache_root import cache_dir

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_attention.c"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
log = logging.getLogger("kvpilot.engine")


def _cpu_identity() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))


def build_decode_kernel(compiler: str | None = None) -> Path:
    """The shared library's path, compiled now unless cached. Raises OSError or
    subprocess.CalledProcessError when it cannot be built."""
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise OSError("no C compiler (cc, gcc or $CC) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join(
        [SOURCE.read_text(), " ".join(CFLAGS), version, _cpu_identity()]).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"paged_decode_attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", str(built), "-lm"],
                       capture_output=True, text=True, check=True)
        os.replace(built, target)  # atomic: concurrent builders leave one whole file
    return target


@dataclass
class DecodeKernel:
    library: ctypes.CDLL
    path: Path

    def __call__(
        self,
        query: torch.Tensor,  # [num_seqs, num_heads, head_dim] float32
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] float32
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [num_seqs, width] int32
        seq_lens: torch.Tensor,  # [num_seqs] int32, each in [1, width * block_size]
        scale: float,
    ) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
        query, block_tables = query.contiguous(), block_tables.contiguous()
        seq_lens = seq_lens.contiguous()
        num_seqs, num_heads, head_dim = query.shape
        num_blocks, block_size, kv_heads, _ = k_cache.shape
        if k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32:
            raise ValueError(f"the decode kernel reads float32 caches, got {k_cache.dtype}")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the decode kernel needs contiguous K/V caches")
        out = torch.empty_like(query)
        c_float = ctypes.c_float
        self.library.paged_decode_attention_f32(
            query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            seq_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, kv_heads, head_dim,
            block_size, block_tables.shape[1], c_float(scale), torch.get_num_threads())
        return out


def load_decode_kernel() -> DecodeKernel | None:
    """The compiled kernel, or None (logged once by the caller's describe) if it cannot
    be built or loaded here."""
    try:
        path = build_decode_kernel()
        library = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.info("CPU decode kernel unavailable, SDPA decode instead: %s", detail.strip()[:300])
        return None
    fn = library.paged_decode_attention_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int]
    return DecodeKernel(library, path)
