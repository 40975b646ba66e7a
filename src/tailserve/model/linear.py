"""Linear layers with an optional oneDNN-packed weight for fast CPU inference.

PyTorch's default CPU ``F.linear`` reaches a fraction of memory bandwidth for the
matrix-vector products of batch-1 decode, worst in bfloat16 (measured here: ~9 GB/s for
bf16, vs ~26+ GB/s for the same product through oneDNN with the weight reordered once into
its blocked layout). ``pack_for_cpu`` does that reorder at load time; the packed weight
replaces the plain one (no second copy is kept). Results are the same kernels' arithmetic
in the same dtype; tests compare both paths against transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear(nn.Module):
    def __init__(self, out_features: int, in_features: int, bias: bool) -> None:
        super().__init__()
        # Built on the meta device; the loader assigns real storage.
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def pack_for_cpu(self, keep_weight: bool = False) -> bool:
        """Reorder the weight for oneDNN. Returns False (and changes nothing) if this build or
        CPU cannot run the packed kernel for the weight's dtype."""
        w = self.weight
        if w.device.type != "cpu" or not onednn_available():
            return False
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach())
            probe = torch.zeros(1, w.shape[1], dtype=w.dtype)
            torch.ops.mkldnn._linear_pointwise(probe, packed, self.bias, "none", [], "")
        except RuntimeError:
            return False
        self.packed = packed
        if not keep_weight:
            self.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)
        return True
