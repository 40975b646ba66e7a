"""Attention backends: the interface (``backend``) and the pure-PyTorch reference (``reference``)."""

from tailserve.attention.backend import AttentionBackend, DecodeGraph, LayerAttentionMetadata, PagedBatch
from tailserve.attention.reference import TorchReferenceBackend

__all__ = ["AttentionBackend", "DecodeGraph", "LayerAttentionMetadata", "PagedBatch", "TorchReferenceBackend",
           "get_attention_backend"]


def get_attention_backend(name: str = "auto") -> type[AttentionBackend]:
    """The backend class for ``name``: "auto" and "torch" mean the reference (the Triton
    kernel has passed only its interpreter tests so far); "triton" the paged Triton kernel
    (``tailserve.attention.triton_paged``, needs ``pip install triton``)."""
    if name in ("auto", "torch", TorchReferenceBackend.name):
        return TorchReferenceBackend
    if name in ("triton", "triton-paged"):
        try:
            from tailserve.attention.triton_paged import TritonPagedBackend
        except ImportError as e:
            raise ValueError(f"attention backend 'triton' needs Triton: pip install triton ({e})") from None
        return TritonPagedBackend
    raise ValueError(f"unknown attention backend {name!r}")
