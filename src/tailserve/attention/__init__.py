"""Attention backends: the interface (``backend``) and the pure-PyTorch reference (``reference``)."""

from tailserve.attention.backend import AttentionBackend, DecodeGraph, LayerAttentionMetadata, PagedBatch
from tailserve.attention.reference import TorchReferenceBackend

__all__ = ["AttentionBackend", "DecodeGraph", "LayerAttentionMetadata", "PagedBatch", "TorchReferenceBackend",
           "get_attention_backend"]


def get_attention_backend(name: str = "auto") -> type[AttentionBackend]:
    """The backend class for ``name`` ("auto" and "torch" both mean the reference for now)."""
    if name in ("auto", "torch", TorchReferenceBackend.name):
        return TorchReferenceBackend
    raise ValueError(f"unknown attention backend {name!r}")
