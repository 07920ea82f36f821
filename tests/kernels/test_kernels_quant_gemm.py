"""Integer-weight GEMM (kernels/quant_gemm.py): the Triton kernel (interpreted) against its
torch reference over odd shapes, the reference against an oracle that never unpacks, input
checks (its offline compile for sm_90 is checked with the other kernels', in
tests/kernels/check/test_kernels_gpu_check.py).

bf16 under the interpreter runs with its dots upcast to fp32 and its bf16 roundings done by
hand (the interpreter's bf16 cast truncates), so every dtype is held to QUANT_GEMM_RTOL.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kvpilot.kernels.quant_pack import pack_along_k, per_word, quantize_rtn  # noqa: E402
from kvpilot.kernels import quant_gemm  # noqa: E402
from kvpilot.kernels.quant_gemm import QUANT_GEMM_RTOL, quant_matmul, quant_matmul_reference  # noqa: E402
from kvpilot.kernels.testing import rel_error  # noqa: E402

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def make_weight(k: int, n: int, bits: int, group_size: int, dtype: torch.dtype, seed: int = 0):
    """Random integers over the full range [0, 2**bits) (so words with the sign bit set
    occur), integer zeros anywhere in that range, positive scales. Returns the packed
    tensors and the float64 weight W.T [K, N] computed from the unpacked integers."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group_size)
    q = torch.randint(0, 1 << bits, (k, n), generator=gen, dtype=torch.int32)  # [K, N]
    zeros = torch.randint(0, 1 << bits, (groups, n), generator=gen).to(dtype)  # [num_groups, N]
    scales = (0.005 + 0.05 * torch.rand(groups, n, generator=gen)).to(dtype)  # [num_groups, N]
    g = torch.arange(k) // group_size  # [K]
    w_t = (q.double() - zeros.double()[g]) * scales.double()[g]  # [K, N]
    return pack_along_k(q, bits), scales, zeros, w_t


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty returns NaN-filled float tensors, so an output element the kernel
    never writes shows up."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


# (M, K, N, bits, group_size (None: per-channel), dtype, bias). The launch config picks
# BLOCK_K 128 for M <= 16 and 64 above, so group 64/32 at M <= 16 takes the per-row-group
# path, and group 64/128/per-channel above it the one-group-per-tile path.
CASES = {
    "m1-int4-g64-k200-n1000-fp32-bias": (1, 200, 1000, 4, 64, F32, True),
    "m1-int8-g64-k200-n1000-fp16": (1, 200, 1000, 8, 64, F16, False),
    "m3-int8-g128-k96-one-partial-group-fp16-bias": (3, 96, 40, 8, 128, F16, True),
    "m3-int4-g32-k256-fp32": (3, 256, 72, 4, 32, F32, False),
    "m17-int4-perchannel-k200-fp16-bias": (17, 200, 70, 4, None, F16, True),
    "m17-int8-g64-k200-fp32": (17, 200, 130, 8, 64, F32, False),
    "m17-int4-g128-k96-fp32-bias": (17, 96, 1000, 4, 128, F32, True),
    "m3-int8-perchannel-k96-bf16-bias": (3, 96, 64, 8, None, BF16, True),
    "m17-int4-g64-k200-bf16": (17, 200, 90, 4, 64, BF16, False),
    "m70-int4-g128-k256-fp16-bias": (70, 256, 150, 4, 128, F16, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference_and_reference_matches_oracle(name, nan_empty):
    m, k, n, bits, group_size, dtype, with_bias = CASES[name]
    group_size = group_size or k
    qweight, scales, zeros, w_t = make_weight(k, n, bits, group_size, dtype, seed=len(name))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=gen).to(dtype)  # [M, K]
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None  # [N]

    out = quant_matmul(x, qweight, scales, zeros, bits, group_size, bias)
    ref = quant_matmul_reference(x, qweight, scales, zeros, bits, group_size, bias)
    assert out.shape == (m, n) and out.dtype == dtype
    assert not out.isnan().any()
    assert rel_error(out, ref) <= QUANT_GEMM_RTOL[dtype]

    # The reference, against float64 math on integers that were never packed: only the
    # weight's rounding to the dtype (the engine's float weight) and the output's rounding.
    oracle = x.double() @ w_t.to(dtype).double() + (bias.double() if bias is not None else 0.0)
    assert rel_error(ref, oracle) <= {F32: 1e-6, F16: 1e-3, BF16: 8e-3}[dtype]


@pytest.mark.parametrize(("bits", "group_size", "symmetric"), [(4, 128, False), (8, None, True)])
def test_kernel_on_quantize_rtn_weights_approximates_the_float_layer(bits, group_size, symmetric):
    """The engine's own path: quantize a float weight, multiply; the result is the float
    layer's up to quantization error, and the reference's up to the stated tolerance."""
    gen = torch.Generator().manual_seed(2)
    n, k = 48, 160
    weight = torch.randn(n, k, generator=gen).half()  # [N, K]
    x = torch.randn(5, k, generator=gen).half()  # [M, K]
    w = quantize_rtn(weight, bits, group_size, symmetric)
    out = quant_matmul(x, w.qweight, w.scales, w.zeros, w.bits, w.group_size)
    ref = quant_matmul_reference(x, w.qweight, w.scales, w.zeros, w.bits, w.group_size)
    assert rel_error(out, ref) <= QUANT_GEMM_RTOL[F16]
    assert rel_error(out, x.float() @ weight.float().t()) <= (0.15 if bits == 4 else 0.01)


def test_kernel_takes_strided_inputs():
    """x sliced out of a wider activation, and a qweight/scales/zeros column slice (a fused
    projection split after packing): strides are honoured."""
    k, n, bits, group_size = 64, 96, 4, 32
    qweight, scales, zeros, _ = make_weight(k, 2 * n, bits, group_size, F32, seed=5)
    wide = torch.randn(4, 2 * k)
    x = wide[:, 1::2]  # [4, K], stride (2K, 2)
    args = (x, qweight[:, n:], scales[:, n:], zeros[:, n:], bits, group_size)
    out = quant_matmul(*args)
    assert rel_error(out, quant_matmul_reference(*args)) <= QUANT_GEMM_RTOL[F32]


@pytest.mark.parametrize(("m", "k", "n", "bits", "group_size", "dtype", "split_k"), [
    (1, 1024, 96, 4, 128, BF16, 4),  # 8 K tiles of 128: 4 slices of 2
    (17, 200, 130, 8, 64, F16, 3),  # 4 tiles of 64 (the last partial): 2 slices of 2
    (3, 256, 40, 4, 32, F32, 5),  # 2 tiles: at most 2 slices
])
def test_split_k_matches_reference(m, k, n, bits, group_size, dtype, split_k, nan_empty):
    qweight, scales, zeros, _ = make_weight(k, n, bits, group_size, dtype, seed=m)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(m, k, generator=gen).to(dtype)  # [M, K]
    bias = torch.randn(n, generator=gen).to(dtype)  # [N]: added once, not once per slice
    args = (x, qweight, scales, zeros, bits, group_size, bias)
    out = quant_matmul(*args, split_k=split_k)
    assert not out.isnan().any() and out.dtype == dtype
    assert rel_error(out, quant_matmul_reference(*args)) <= QUANT_GEMM_RTOL[dtype]
    assert rel_error(out, quant_matmul(*args, split_k=1)) <= QUANT_GEMM_RTOL[dtype]


@pytest.mark.parametrize(("programs", "k_tiles", "sms", "expected"), [
    (128, 32, 132, 3),  # M=1, N=4096 / 32: 3 slices reach two programs per SM
    (448, 32, 132, 1),  # N=14336: already enough programs
    (1, 1000, 132, quant_gemm.MAX_SPLIT_K),
    (64, 10, 132, 2),  # capped by MIN_K_TILES_PER_SPLIT
    (64, 7, 132, 1),  # too short to split
    (4, 64, 1, 1),  # CPU / interpreter: one "SM"
    (0, 64, 132, 1),
])
def test_choose_split_k(programs, k_tiles, sms, expected):
    assert quant_gemm.choose_split_k(programs, k_tiles, sms) == expected


def test_default_split_k_on_llama_shapes(monkeypatch):
    """On an H100/H200-sized GPU (132 SMs) a grid under two programs per SM splits K; off
    CUDA nothing does."""
    monkeypatch.setattr(quant_gemm, "_num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert quant_gemm.default_split_k(1, 4096, 4096, 4, cuda) == 3  # 128 programs of 16 x 32
    assert quant_gemm.default_split_k(16, 4096, 4096, 8, cuda) == 3
    assert quant_gemm.default_split_k(1, 14336, 4096, 4, cuda) == 1  # 448 programs
    assert quant_gemm.default_split_k(256, 4096, 4096, 4, cuda) == 5  # 64 programs of 128 x 128
    assert quant_gemm.default_split_k(1, 4096, 4096, 4, torch.device("cpu")) == 1


def test_empty_batch_returns_empty_output():
    qweight, scales, zeros, _ = make_weight(32, 16, 8, 32, F16)
    out = quant_matmul(torch.empty(0, 32, dtype=F16), qweight, scales, zeros, 8, 32)
    assert out.shape == (0, 16) and out.dtype == F16


def test_launch_config_fits_the_kernel():
    for m in (1, 2, 15, 16, 17, 33, 64, 65, 256, 8192):
        config = quant_gemm._launch_config(m, 4096, 4096, 4)
        assert config["BLOCK_M"] >= 16 and config["BLOCK_N"] >= 16
        for bits in (4, 8):
            assert config["BLOCK_K"] % per_word(bits) == 0
    # group 128 (the common checkpoint) lies in one group per K tile at every M.
    assert all(128 % quant_gemm._launch_config(m, 4096, 4096, 4)["BLOCK_K"] == 0 for m in (1, 64, 256))


def _good_args():
    qweight, scales, zeros, _ = make_weight(64, 24, 4, 32, F16)
    return {"x": torch.randn(3, 64).half(), "qweight": qweight, "scales": scales, "zeros": zeros,
            "bits": 4, "group_size": 32, "bias": torch.zeros(24, dtype=F16)}


BAD_INPUTS = {
    "x-3d": ("x", lambda a: a["x"].unsqueeze(0)),
    "x-int": ("x", lambda a: a["x"].to(torch.int32)),
    "x-wrong-k": ("qweight", lambda a: a["x"][:, :56]),
    "bits-3": ("bits", 3),
    "group-size-0": ("group_size", 0),
    "group-size-float": ("group_size", 32.0),
    "qweight-float": ("qweight", lambda a: a["qweight"].float()),
    "qweight-1d": ("qweight", lambda a: a["qweight"].flatten()),
    "scales-wrong-groups": ("scales", lambda a: a["scales"][:1]),
    "scales-fp32": ("scales", lambda a: a["scales"].float()),
    "zeros-wrong-n": ("zeros", lambda a: a["zeros"][:, :23]),
    "zeros-bf16": ("zeros", lambda a: a["zeros"].bfloat16()),
    "bias-wrong-n": ("bias", lambda a: a["bias"][:5]),
    "bias-fp32": ("bias", lambda a: a["bias"].float()),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
@pytest.mark.parametrize("fn", [quant_matmul, quant_matmul_reference])
def test_bad_input_raises_value_error_naming_the_argument(name, fn):
    arg, change = BAD_INPUTS[name]
    args = _good_args()
    field = "x" if name.startswith("x-") else arg
    args[field] = change(args) if callable(change) else change
    with pytest.raises(ValueError, match=rf"^{arg}\b"):
        fn(**args)


# Compiling every variant for Hopper (sm_90, no register spills) is part of
# tests/kernels/check/test_kernels_gpu_check.py::test_every_kernel_compiles_for_hopper_without_spills_on_llama_shapes.
