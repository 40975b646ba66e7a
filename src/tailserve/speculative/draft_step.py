"""One draft-chain step of a single sequence, behind one protocol with two implementations.

The draft chain's steps for one sequence (a one- or two-token catch-up, then each draft)
are the hot loop of batch-1 speculation. ``DraftStep.forward`` takes the step's tokens, the
cache slot of every context position and the rotary rows of the new tokens, writes the new
tokens' K/V into the draft's paged cache and returns the last token's logits:

- ``TorchDraftStep``: the draft model's own PyTorch forward (any device, any dtype).
- ``NumpyDraftStep`` (``numpy_draft.py``) through ``NumpyStepAdapter``: the same step in
  NumPy over array views of the same float32 cache, for small drafts on the CPU, where
  PyTorch's per-operation overhead dominates.

``make_draft_step`` picks one; the choice is the worker's (``DraftPlan.numpy_step``), made
once at load time.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from tailserve.attention.backend import upcasts_attention
from tailserve.attention.reference import decode_metadata
from tailserve.model.config import ModelArchConfig
from tailserve.model.llama import LlamaFamilyModel
from tailserve.speculative.numpy_draft import NumpyDraftStep


class DraftStep(Protocol):
    name: str
    num_forwards: int

    def forward(self, tokens: list[int], kv_slots: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """tokens: the newest Q tokens (the last Q positions of the context); kv_slots (C,):
        cache slot of every context position; cos/sin (Q, 1, D). Returns (1, V) logits
        (the model's dtype, or float32)."""
        ...


class TorchDraftStep:
    name = "torch"

    def __init__(self, model: LlamaFamilyModel, kv_caches: list[torch.Tensor], device: torch.device) -> None:
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.upcast = upcasts_attention(device)
        self.num_forwards = 0

    def forward(self, tokens: list[int], kv_slots: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        self.num_forwards += 1
        q = len(tokens)
        c = kv_slots.shape[0]
        meta = decode_metadata(kv_slots[c - q :], kv_slots[None], None, q, self.upcast)
        hidden = self.model.forward(torch.tensor(tokens, device=self.device), None, self.kv_caches, meta,
                                    rope=(cos, sin))
        if q > 1:
            hidden = hidden[q - 1 :]
        return self.model.compute_logits(hidden, upcast=False)


class NumpyStepAdapter:
    name = "numpy"

    def __init__(self, step: NumpyDraftStep) -> None:
        self.step = step
        self.num_forwards = 0

    def forward(self, tokens: list[int], kv_slots: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        self.num_forwards += 1
        logits = self.step.forward(np.asarray(tokens, dtype=np.int64), kv_slots.numpy(), cos.numpy(), sin.numpy())
        return torch.from_numpy(logits[None])  # (1, V) float32


def make_draft_step(model: LlamaFamilyModel, arch: ModelArchConfig, kv_caches: list[torch.Tensor],
                    device: torch.device, use_numpy: bool) -> DraftStep:
    """The single-sequence chain step. ``use_numpy`` needs a float32 draft on the CPU, built
    before the model's linear method repacks its weights (the NumPy step copies them)."""
    if use_numpy:
        return NumpyStepAdapter(NumpyDraftStep(model, arch, kv_caches))
    return TorchDraftStep(model, kv_caches, device)
