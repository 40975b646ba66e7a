"""Attention backends: the interface (``backend``), the pure-PyTorch reference (``reference``),
the CPU decode kernel's (``cpu_decode``) and the paged Triton kernel's (``triton_paged``).
Which one runs is the execution plan's decision (engine/plan.py)."""

from tailserve.attention.backend import AttentionBackend, DecodeGraph, LayerAttentionMetadata, PagedBatch
from tailserve.attention.reference import TorchReferenceBackend

__all__ = ["AttentionBackend", "DecodeGraph", "LayerAttentionMetadata", "PagedBatch", "TorchReferenceBackend"]
