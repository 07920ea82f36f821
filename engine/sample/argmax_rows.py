"""Row-wise argmax over a `[rows, vocab]` logits tensor, faster on the CPU than
`Tensor.argmax(dim=-1)`.

torch's CPU argmax over the last dimension runs a scalar loop (about 1 ms for 49 rows
of a 32,000-token vocabulary on the 2-core host, 4 % of a decode step), while `amax`
is vectorised. So: the maximum of each chunk of CHUNK logits (vectorised), the first
chunk holding the row's maximum, then the argmax within that one chunk. Same result as
torch's, ties (first index) and NaN (the first NaN wins, as in torch) included."""

from __future__ import annotations

import torch

CHUNK = 64


def argmax_rows(x: torch.Tensor) -> torch.Tensor:  # x [B, V] -> [B] int64
    if x.device.type != "cpu" or x.dim() != 2 or x.shape[1] < 2 * CHUNK:
        return x.argmax(dim=-1)
    rows, vocab = x.shape
    n = vocab // CHUNK * CHUNK
    chunks = x[:, :n].unflatten(1, (n // CHUNK, CHUNK))  # [B, n / CHUNK, CHUNK] (a view)
    chunk_max = chunks.amax(dim=-1)  # [B, n / CHUNK]; NaN where a chunk holds one
    best = chunk_max.argmax(dim=-1)  # [B] the first chunk with the row's maximum
    index = best * CHUNK + chunks[torch.arange(rows), best].argmax(dim=-1)  # [B]
    if n == vocab:
        return index
    tail = x[:, n:]  # [B, vocab - n] the last, partial chunk
    tail_index = tail.argmax(dim=-1)  # [B]
    main_max = chunk_max.gather(1, best[:, None]).squeeze(1)  # [B]
    tail_max = tail.gather(1, tail_index[:, None]).squeeze(1)  # [B]
    # The earlier index wins a tie; a NaN before the tail wins over anything after it.
    use_main = (main_max >= tail_max) | main_max.isnan()
    return torch.where(use_main, index, n + tail_index)
