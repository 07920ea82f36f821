"""oneDNN linear layers on the CPU: the same outputs as nn.Linear, and a clean fallback
when the ops or the dtype are not there."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from kvpilot.engine.worker import cpu_linear
from kvpilot.engine.worker.cpu_linear import EXACT_ROWS, PackedLinear, pack_linears, packed_linear_available, padded_rows

CPU = torch.device("cpu")


def test_this_torch_has_the_onednn_path_for_float32_only():
    assert packed_linear_available(torch.float32, CPU)
    assert not packed_linear_available(torch.bfloat16, CPU)
    assert not packed_linear_available(torch.float32, torch.device("cuda"))


@pytest.mark.parametrize("rows", [1, 7, 32, 65, 300, 513])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_nn_linear(rows, bias):
    torch.manual_seed(rows)
    lin = nn.Linear(96, 200, bias=bias)
    x = torch.randn(rows, 96)  # [T, in]
    with torch.inference_mode():
        # float32 on the CPU; oneDNN sums in its own order.
        torch.testing.assert_close(PackedLinear(lin)(x), lin(x), rtol=1e-5, atol=1e-5)


def test_row_counts_above_64_run_in_few_buckets_with_at_most_an_eighth_more_rows():
    padded = [padded_rows(r) for r in range(1, 8193)]
    assert padded[:EXACT_ROWS] == list(range(1, EXACT_ROWS + 1))  # decode batches stay exact
    assert all(r <= p <= r * 1.125 for r, p in enumerate(padded, 1))
    assert all(padded_rows(2**k) == 2**k for k in range(13))  # the 2048 budget is not padded
    assert len(set(padded[:2048])) == 64 + 40 and len(set(padded)) == 64 + 56
    assert padded == sorted(padded)


def test_pack_linears_replaces_every_linear_in_place():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False)))
    x = torch.randn(3, 8)
    with torch.inference_mode():
        before = model(x)
        assert pack_linears(model) == 2
        torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())


def test_without_the_ops_everything_stays_nn_linear(monkeypatch):
    def missing(*args, **kwargs):
        raise RuntimeError("no oneDNN here")

    monkeypatch.setattr(cpu_linear.torch.ops.mkldnn, "_reorder_linear_weight", missing, raising=False)
    assert not packed_linear_available(torch.float32, CPU)
