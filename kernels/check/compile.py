"""Compile every kernel variant for a real GPU target without a GPU.

    python -m kvpilot.kernels.check.compile [--arch 90] [--json] [--kernels quant,...]

The interpreter (``TRITON_INTERPRET=1``) is lenient: it runs code that the real
compiler rejects (non-constexpr globals, unsupported dot shapes, type mixes). This
check runs the kernel wrappers on small CPU tensors with ``JITFunction.run``
swapped for "bind the arguments exactly as a launch would, then compile for
``sm_<arch>`` down to a cubin with Triton's bundled ptxas". Nothing is launched.
It reports each variant's shared memory, and registers and spills from ``ptxas -v``.

Must run in a process where ``TRITON_INTERPRET`` is unset or 0 (the tests start it
as a subprocess). Uses Triton internals (``create_function_from_signature``,
``JITFunction._pack_args``); if those move, it falls back to building the
signature itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator

# Variants the engine can hit: (kernel, head_dim, block_size, heads, kv_heads, dtype, num_splits
# [, cache dtype: "fp8" for --kv-cache-dtype fp8; else the query's dtype])
VARIANTS = [
    ("decode", 128, 16, 32, 8, "bfloat16", 1),
    ("decode", 128, 16, 32, 8, "bfloat16", 4),
    ("decode", 64, 32, 8, 1, "float16", 1),
    ("decode", 80, 8, 4, 4, "float16", 2),
    ("decode", 256, 16, 8, 2, "bfloat16", 1),
    ("decode", 32, 16, 8, 4, "float32", 3),
    ("prefill", 128, 16, 32, 8, "bfloat16", None),
    ("prefill", 96, 8, 10, 2, "float16", None),
    ("prefill", 256, 32, 8, 8, "bfloat16", None),
    ("prefill", 32, 16, 8, 4, "float32", None),
    ("write", 128, 16, 8, 8, "bfloat16", None),
    ("write", 80, 32, 4, 4, "float32", None),
    ("decode", 128, 16, 32, 8, "bfloat16", 1, "fp8"),
    ("decode", 128, 16, 32, 8, "float16", 4, "fp8"),
    ("prefill", 128, 16, 32, 8, "bfloat16", None, "fp8"),
    ("prefill", 64, 16, 8, 1, "float16", None, "fp8"),
    ("write", 128, 16, 8, 8, "bfloat16", None, "fp8"),
]

# Integer-weight GEMM variants (kernels/quant_gemm.py): (M, K, N, bits, group_size, dtype,
# bias, split_k). Llama-3-8B layer shapes over the three tile configurations (M <= 16, <= 64,
# larger), both scale paths (one group per K tile; per-row groups when group_size % BLOCK_K
# != 0), split-K (atomic fp32 adds; the CPU's wrapper would never choose it), fp32.
QUANT_VARIANTS = [
    (1, 4096, 14336, 4, 128, "float16", False, None),
    (1, 4096, 4096, 4, 128, "bfloat16", False, 3),
    (16, 4096, 4096, 8, 4096, "bfloat16", True, 4),
    (64, 4096, 4096, 4, 128, "bfloat16", False, None),
    (256, 4096, 14336, 4, 128, "float16", False, None),
    (256, 14336, 4096, 8, 14336, "bfloat16", True, None),
    (3, 200, 1000, 4, 64, "float16", True, None),
    (17, 96, 40, 8, 128, "float32", True, None),
]
KERNEL_FAMILIES = ("decode", "prefill", "write", "quant")


def _ptxas_usage(ptx: str, arch: int) -> dict[str, int]:
    """Registers and spill bytes from ``ptxas -v`` on the kernel's PTX (empty if unavailable)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(arch).path
        suffix = "a" if arch >= 90 else ""
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(ptx)
        try:
            res = subprocess.run(
                [ptxas, "-v", f"--gpu-name=sm_{arch}{suffix}", f.name, "-o", os.devnull],
                capture_output=True, text=True, timeout=120,
            )
        finally:
            os.unlink(f.name)
        text = res.stderr + res.stdout
        usage = {}
        if m := re.search(r"Used (\d+) registers", text):
            usage["registers"] = int(m.group(1))
        if m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text):
            usage["spill_store_bytes"], usage["spill_load_bytes"] = int(m.group(1)), int(m.group(2))
        return usage
    except Exception:
        return {}


@contextlib.contextmanager
def compile_only(arch: int) -> Iterator[list[dict[str, Any]]]:
    """While active, launching any @triton.jit kernel compiles it for sm_<arch> instead."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime import jit

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    records: list[dict[str, Any]] = []
    original_run = jit.JITFunction.run

    def _via_internals(self, args, kwargs):
        binder = jit.create_function_from_signature(self.signature, self.params, backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound_args, specialization, options)
        return ASTSource(self, signature, constexprs, attrs), options.__dict__

    def _by_hand(self, args, kwargs):
        names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                 torch.int32: "i32", torch.int64: "i64"}
        options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        signature, constexprs = {}, {}
        for i, param in enumerate(self.params):
            value = args[i] if i < len(args) else kwargs[param.name]
            if param.is_constexpr:
                signature[param.name], constexprs[param.name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[param.name] = "*" + names[value.dtype]
            elif isinstance(value, bool):
                signature[param.name] = "i1"
            elif isinstance(value, int):
                signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            else:
                signature[param.name] = "fp32"
        return ASTSource(self, signature, constexprs), options

    def fake_run(self, *args, grid, warmup, **kwargs):
        try:
            src, options = _via_internals(self, args, dict(kwargs))
            how = "launch binder"
        except Exception:
            src, options = _by_hand(self, args, kwargs)
            how = "hand-built signature"
        start = time.monotonic()
        kernel = compile(src, target=target, options=options)
        record = {
            "kernel": self.__name__,
            "arch": f"sm_{arch}",
            "signature_from": how,
            "compile_s": round(time.monotonic() - start, 2),
            "shared_bytes": kernel.metadata.shared,
            "num_warps": kernel.metadata.num_warps,
            "num_stages": kernel.metadata.num_stages,
            "has_cubin": bool(kernel.asm.get("cubin")),
        }
        record.update(_ptxas_usage(kernel.asm.get("ptx", ""), arch))
        records.append(record)
        return None

    jit.JITFunction.run = fake_run
    try:
        yield records
    finally:
        jit.JITFunction.run = original_run


def run_quant(arch: int = 90, variants: list[tuple] | None = None) -> list[dict[str, Any]]:
    """Compile the integer-weight GEMM's variants (``QUANT_VARIANTS``)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_check needs TRITON_INTERPRET unset or 0")
    import torch

    from kvpilot.kernels.quant_pack import per_word
    from kvpilot.kernels.quant_gemm import quant_matmul

    rows = []
    for m, k, n, bits, group_size, dtype_name, bias, split_k in variants or QUANT_VARIANTS:
        dtype = getattr(torch, dtype_name)
        groups = -(-k // group_size)
        variant = {"variant": "quant", "m": m, "k": k, "n": n, "bits": bits, "group_size": group_size,
                   "dtype": dtype_name, "bias": bias, "split_k": split_k}
        try:
            with compile_only(arch) as records:
                quant_matmul(torch.zeros(m, k, dtype=dtype),  # [M, K]
                             torch.zeros(k // per_word(bits), n, dtype=torch.int32),  # [K // per_word, N]
                             torch.ones(groups, n, dtype=dtype),  # scales [num_groups, N]
                             torch.zeros(groups, n, dtype=dtype),  # zeros [num_groups, N]
                             bits, group_size,
                             torch.zeros(n, dtype=dtype) if bias else None,  # [N]
                             split_k=split_k)
            rows += [{**variant, **r, "ok": r["has_cubin"]} for r in records]
        except Exception as exc:
            rows.append({**variant, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:4000]})
    return rows


def run(arch: int = 90, variants: list[tuple] | None = None,
        kernels: tuple[str, ...] = KERNEL_FAMILIES) -> list[dict[str, Any]]:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_check needs TRITON_INTERPRET unset or 0")
    import torch

    from kvpilot.kernels.kv_cache_write import write_kv_cache
    from kvpilot.kernels.paged_decode_attention import paged_decode_attention
    from kvpilot.kernels.paged_prefill_attention import paged_prefill_attention
    from kvpilot.kernels.testing import fp8_case, make_paged_case

    rows = []
    for kernel, head_dim, block_size, heads, kv_heads, dtype_name, splits, *cache in variants or VARIANTS:
        if kernel not in kernels:
            continue
        dtype = getattr(torch, dtype_name)
        lens = [block_size + 1, 3 * block_size]
        q_lens = [1, 1] if kernel == "decode" else [block_size + 1, 5]
        case = make_paged_case(lens, q_lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                               block_size=block_size, dtype=dtype)
        cache_dtype = cache[0] if cache else dtype_name
        if cache_dtype == "fp8":
            case = fp8_case(case, 0.5, 0.5)[0]
        variant = {"variant": kernel, "head_dim": head_dim, "block_size": block_size,
                   "group": heads // kv_heads, "dtype": dtype_name, "num_splits": splits,
                   "cache_dtype": cache_dtype}
        try:
            with compile_only(arch) as records:
                if kernel == "decode":
                    paged_decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                           case.seq_lens, case.scale, splits)
                elif kernel == "prefill":
                    paged_prefill_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                            case.seq_lens, case.query_start_loc, case.max_query_len, case.scale)
                else:
                    write_kv_cache(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
            rows += [{**variant, **r, "ok": r["has_cubin"]} for r in records]
        except Exception as exc:
            rows.append({**variant, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:4000]})
    if "quant" in kernels and variants is None:
        rows += run_quant(arch)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpilot.kernels.check.compile", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90 = H100/H200)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--kernels", default=",".join(KERNEL_FAMILIES),
                        help=f"comma-separated kernel families to compile (default: all of {','.join(KERNEL_FAMILIES)})")
    args = parser.parse_args(argv)
    kernels = tuple(k.strip() for k in args.kernels.split(",") if k.strip())
    if unknown := set(kernels) - set(KERNEL_FAMILIES):
        parser.error(f"--kernels: unknown {sorted(unknown)}; choose from {','.join(KERNEL_FAMILIES)}")
    rows = run(args.arch, kernels=kernels)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            status = "ok " if r["ok"] else "FAIL"
            detail = r.get("error") or (
                f"{r['kernel']}: {r.get('registers', '?')} regs, spills {r.get('spill_store_bytes', '?')}B, "
                f"smem {r['shared_bytes']}B, {r['compile_s']}s"
            )
            if r["variant"] == "quant":
                print(f"{status} quant   M={r['m']:3d} K={r['k']:5d} N={r['n']:5d} int{r['bits']} g={r['group_size']} "
                      f"{r['dtype']:8s} bias={r['bias']} split_k={r['split_k']}: {detail}")
                continue
            print(f"{status} {r['variant']:7s} d={r['head_dim']:3d} bs={r['block_size']:2d} g={r['group']} "
                  f"{r['dtype']:8s} cache={r['cache_dtype']:8s} splits={r['num_splits']}: {detail}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
