"""What the prefix cache tells a KV-aware router: blocks stored under a hash, blocks removed,
everything cleared (vLLM's ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``).

The block pool records events in a ``KVEventLog`` as it caches and evicts blocks; the engine
drains the log after each step and hands the batch to its publisher
(engine/kv_event_publisher.py). Events are plain data and only announce what the cache
index holds: a block stored is one a later prompt can hit (``BlockPool.cache_block`` took
it), a block removed is one whose hash was dropped to reuse the block. Consecutive stores
of one chain merge into one event (each block's parent is the previous hash), as do
consecutive removals, so a prompt of 100 blocks costs one event, not 100.
"""

from __future__ import annotations

from dataclasses import dataclass

from tailserve.memory.block_hash import BlockHash


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None  # the block before the first of these; None: a prompt's first block
    token_ids: tuple[int, ...]  # block_size tokens per hash, in order
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """Pending events, in order, merged where they continue each other."""

    def __init__(self) -> None:
        # ("stored", hashes, parent, tokens, block_size) | ("removed", hashes); AllBlocksCleared
        # is the publisher's own (at its start and shutdown), never the pool's.
        self._pending: list[list] = []

    def __len__(self) -> int:
        return len(self._pending)

    def stored(self, block_hash: BlockHash, parent: BlockHash | None, token_ids: tuple[int, ...],
               block_size: int) -> None:
        last = self._pending[-1] if self._pending else None
        if last is not None and last[0] == "stored" and last[1][-1] == parent and last[4] == block_size:
            last[1].append(block_hash)
            last[3].extend(token_ids)
        else:
            self._pending.append(["stored", [block_hash], parent, list(token_ids), block_size])

    def removed(self, block_hash: BlockHash) -> None:
        last = self._pending[-1] if self._pending else None
        if last is not None and last[0] == "removed":
            last[1].append(block_hash)
        else:
            self._pending.append(["removed", [block_hash]])

    def drain(self) -> list[KVEvent]:
        out: list[KVEvent] = []
        for e in self._pending:
            if e[0] == "stored":
                out.append(BlockStored(tuple(e[1]), e[2], tuple(e[3]), e[4]))
            else:
                out.append(BlockRemoved(tuple(e[1])))
        self._pending = []
        return out
