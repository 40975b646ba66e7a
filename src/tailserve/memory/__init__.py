"""Paged KV cache: block pool, prefix cache, KV tensors and their utilisation figures."""
