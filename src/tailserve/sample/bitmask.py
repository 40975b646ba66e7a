"""Grammar bitmasks applied to a batch of logits (constrained decoding, ``structured/``).

A bitmask is (R, ceil(V / 32)) int32, bit ``t % 32`` of word ``t // 32`` set when token t
is allowed (llguidance's layout); row r masks logits row ``rows[r]`` in place: every
disallowed token becomes -inf, so greedy, sampling, the rejection sampler and the logprobs
all see the masked distribution. One call for the batch: the compiled CPU kernel where the
execution plan runs the sampler's kernels (measured in docs/benchmarks.md: it skips words
that allow all or nothing), else one vectorised unpack-and-fill on the logits' device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from tailserve.kernels.cpu import CpuKernels


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray,
                        kernels: CpuKernels | None = None) -> None:
    """Mask ``logits`` (N, V) float32 in place: row ``rows[r]`` by ``bitmask[r]``."""
    if not rows:
        return
    mask = torch.from_numpy(np.ascontiguousarray(bitmask, dtype=np.int32))
    if kernels is not None and logits.dtype == torch.float32 and logits.stride(1) == 1:  # kernels: the plan's
        kernels.apply_token_bitmask(logits, torch.tensor(rows, dtype=torch.int64), mask)
        return
    v = logits.shape[1]
    dev = logits.device
    mask = mask.to(dev, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=dev)
    allowed = ((mask.unsqueeze(-1) >> shifts) & 1).view(mask.shape[0], -1)[:, :v].bool()  # (R, V)
    idx = torch.tensor(rows, dtype=torch.long, device=dev)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
