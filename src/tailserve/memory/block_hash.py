"""The prefix cache's block hash: ``hash(parent_hash, token_ids)`` chained block by block.

Two functions, chosen by ``--prefix-caching-hash-algo`` (vLLM's flag):

- ``builtin``: Python's ``hash((parent, token_ids))``. Fastest; deterministic across
  processes (ints and tuples are not salted by PYTHONHASHSEED), but only CPython can
  recompute it.
- ``sha256_cbor_64bit``: the low 64 bits (the last 8 bytes, big-endian) of SHA-256 over the
  canonical CBOR encoding of ``[parent, token_ids, null]``; a sequence's first block takes as
  parent the same 64 bits of SHA-256 over the CBOR text string of the hash seed (the
  PYTHONHASHSEED environment variable, "" when unset). It is vLLM's ``sha256_cbor_64bit``
  and what llm-d's KV-cache indexer computes from a prompt's tokens (its ``hashSeed``
  is the same seed, its ``blockSize`` our ``--block-size``), so a router can find the blocks
  that KV events (engine/kv_event_publisher.py) announce.

Either way, a hash hit is confirmed by comparing token ids (memory/block_pool.py), so a
64-bit collision can never share the wrong block.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

from tailserve.errors import ConfigError

BlockHash = int
HashFn = Callable[[BlockHash | None, tuple[int, ...]], BlockHash]


def builtin_block_hash(parent: BlockHash | None, token_ids: tuple[int, ...]) -> BlockHash:
    return hash((parent, token_ids))


def _low64(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[24:], "big")


def sha256_cbor_64bit(seed: str | None = None) -> HashFn:
    """The portable hash; ``seed``: the first block's parent seed (default PYTHONHASHSEED or "")."""
    try:
        import cbor2
    except ImportError:
        raise ConfigError("prefix_caching_hash_algo sha256_cbor_64bit needs cbor2: pip install "
                          "'tailserve[kv-events]'") from None
    dumps = cbor2.dumps
    root = _low64(dumps(os.environ.get("PYTHONHASHSEED", "") if seed is None else seed, canonical=True))

    def block_hash(parent: BlockHash | None, token_ids: tuple[int, ...]) -> BlockHash:
        return _low64(dumps([root if parent is None else parent, list(token_ids), None], canonical=True))

    return block_hash


def block_hash_fn(algo: str) -> HashFn:
    if algo == "builtin":
        return builtin_block_hash
    if algo == "sha256_cbor_64bit":
        return sha256_cbor_64bit()
    raise ConfigError(f"unknown prefix caching hash algorithm {algo!r}")
