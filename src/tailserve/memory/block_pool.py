"""The KV block pool: reference-counted fixed-size blocks with a prefix cache on top.

A block holds ``block_size`` tokens' K/V in every layer. Requests own blocks through their
block tables; a full block whose tokens are known gets a *chained* hash,
``hash(parent_hash, token_ids)`` (memory/block_hash.py), so equal hashes mean equal whole prefixes. On a hash hit
the token ids are compared too, so even a hash collision never shares the wrong block.
Freed blocks that carry a hash stay in the free queue, reusable, until they are evicted
least recently used first; blocks without a hash are handed out before any cached one.

Pinned blocks (``pin``: a request that ended in a tool call, whose agent will likely send
the same prefix again once the tool has run) are free but kept apart until their time is
up: they are handed out only when no other block is free, soonest expiry first.

Runs: a sequence's blocks are placed side by side where they can be. Each block handed out
holds back the next ``reserve_ahead`` free, uncached block ids for the sequence that took it
(``allocate(after=...)`` continues the run), so sequences that grow a block at a time beside
each other do not interleave their blocks, and the decode attention reads a sequence's K/V
in long runs instead of jumping at most block boundaries (on the CPU a jump costs a
prefetch miss per row; docs/benchmarks.md). Held-back blocks are free: they are handed out
to anyone before a cached block is evicted, and go back to the free queue when the block
before them is freed. Placement only: which blocks are cached, evicted or pinned, and when,
is what it would be without runs.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tailserve.memory.block_hash import BlockHash, HashFn, builtin_block_hash
from tailserve.memory.kv_events import KVEventLog


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None  # set together with block_hash
    parent_hash: BlockHash | None = None  # the hash of the block before it (None: the first)
    # A draft model (speculative decoding) keeps its own K/V in the same block ids; this says
    # that all of this block's tokens have the draft's K/V too, so a prefix hit can skip them
    # in the draft as well. Reset whenever the block is handed out again.
    draft_filled: bool = False


@dataclass
class PrefixCacheStats:
    queries_tokens: int = 0  # prompt tokens looked up at admission
    hits_tokens: int = 0  # of those, tokens found in cached blocks
    evictions: int = 0  # cached blocks whose hash was dropped to reuse the block
    pinned_blocks: int = 0  # blocks pinned after their request (``pin``)
    pinned_hits: int = 0  # pinned blocks a later admission took as prefix-cache hits before expiry
    pinned_taken: int = 0  # pinned blocks handed out before expiry because nothing else was free

    queries_requests: int = 0  # admissions that looked up the prefix cache
    hits_requests: int = 0  # of those, admissions that found at least one cached block
    # The rates derived from these counts are KVCacheFigures' (memory/kv_figures.py), once.


@dataclass
class BlockPool:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    hash_fn: HashFn = builtin_block_hash
    clock: Callable[[], float] = time.monotonic  # for pins' expiry
    # Where cache_block and evictions are announced (KV events for routers); None: nowhere.
    events: KVEventLog | None = None
    # Free, uncached block ids held back behind each block handed out, for its sequence's next
    # blocks (see the module's docstring); 0: none, blocks in free-queue order only.
    reserve_ahead: int = 7
    blocks: list[Block] = field(init=False)
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        if self.reserve_ahead < 0:
            raise ValueError("reserve_ahead must be >= 0")
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        # Free blocks, eviction order first. Values unused; OrderedDict gives O(1) removal.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(self.num_blocks))
        self._cached: dict[BlockHash, int] = {}
        # Cached blocks by their parent's hash and first token: where a prompt that matched up
        # to a block leaves the cache inside the next one (``first_divergence``).
        self._children: dict[BlockHash | None, dict[int, set[int]]] = {}
        # Free pinned blocks -> expiry (clock seconds), soonest first; pins of blocks in use.
        self._free_pinned: OrderedDict[int, float] = OrderedDict()
        self._pin_until: dict[int, float] = {}
        # Free, uncached blocks held back for the run of the block before them, oldest first.
        self._reserved: OrderedDict[int, None] = OrderedDict()

    # -- queries -----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._reserved) + len(self._free_pinned)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_pinned_free_blocks(self) -> int:
        return len(self._free_pinned)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_block_hashes(self) -> set[BlockHash]:
        """The hashes a prompt can hit now (what KV events let a router rebuild)."""
        return set(self._cached)

    # -- allocation ----------------------------------------------------------------------
    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """Take n free blocks (ref count 1) for one sequence whose last block is ``after``
        (None: a new sequence). Raises if fewer are free: callers check first.

        Each block is, in this order: the one after the previous if it is held back for it;
        the first uncached block of the free queue; a block held back for another sequence's
        run; the least recently used cached block (evicted); a pinned block, soonest expiry
        first."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free_blocks} free")
        self._expire_pins()
        out = []
        prev = after
        for _ in range(n):
            if prev is not None and prev + 1 in self._reserved:
                block_id = prev + 1
                del self._reserved[block_id]
            elif self._free and (not self._reserved or self.blocks[next(iter(self._free))].block_hash is None):
                block_id, _ = self._free.popitem(last=False)
            elif self._reserved:  # before evicting a cached block
                block_id, _ = self._reserved.popitem(last=False)
            elif self._free:
                block_id, _ = self._free.popitem(last=False)
            else:  # only pinned blocks left: the one whose pin ends soonest
                block_id, _ = self._free_pinned.popitem(last=False)
                self.stats.pinned_taken += 1
            self._pin_until.pop(block_id, None)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
            block.draft_filled = False
            out.append(block_id)
            self._hold_back_after(block_id)
            prev = block_id
        return out

    def _hold_back_after(self, block_id: int) -> None:
        """Hold back the free, uncached blocks right after ``block_id`` (up to reserve_ahead)."""
        for j in range(block_id + 1, min(block_id + 1 + self.reserve_ahead, self.num_blocks)):
            if j in self._reserved:
                continue
            if j not in self._free or self.blocks[j].block_hash is not None:
                break
            del self._free[j]
            self._reserved[j] = None

    def _release_after(self, block_id: int) -> None:
        """Return the blocks held back after ``block_id`` (now free) to the front of the free
        queue, in block order."""
        end = block_id + 1
        while end in self._reserved:
            end += 1
        for j in range(end - 1, block_id, -1):
            del self._reserved[j]
            self._free[j] = None
            self._free.move_to_end(j, last=False)

    def _evict(self, block: Block) -> None:
        if self._cached.get(block.block_hash) == block.block_id:  # type: ignore[arg-type]
            del self._cached[block.block_hash]  # type: ignore[arg-type]
            if self.events is not None:
                self.events.removed(block.block_hash)  # type: ignore[arg-type]
            assert block.token_ids is not None
            by_first = self._children[block.parent_hash]
            ids = by_first[block.token_ids[0]]
            ids.discard(block.block_id)
            if not ids:
                del by_first[block.token_ids[0]]
                if not by_first:
                    del self._children[block.parent_hash]
        block.block_hash = None
        block.parent_hash = None
        block.token_ids = None
        self.stats.evictions += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block. Freed in reverse so a request's tail blocks
        (least likely to be shared) are evicted before its head blocks."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._release_after(block_id)
                until = self._pin_until.get(block_id)
                if until is not None and block.block_hash is not None and until > self.clock():
                    self._insert_pinned(block_id, until)
                    continue
                self._pin_until.pop(block_id, None)
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    # -- pins ------------------------------------------------------------------------------
    def pin(self, block_ids: Sequence[int], seconds: float) -> list[int]:
        """Keep these blocks' cached K/V for ``seconds`` from now: while free they are handed
        out only after every unpinned free block. Blocks without a hash (nothing to reuse) are
        not pinned. Returns those that were."""
        until = self.clock() + seconds
        pinned = []
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.block_hash is None or seconds <= 0:
                continue
            until_b = max(until, self._pin_until.get(block_id, until))
            self._pin_until[block_id] = until_b
            if block.ref_count == 0:
                self._free.pop(block_id, None)
                self._free_pinned.pop(block_id, None)
                self._insert_pinned(block_id, until_b)
            pinned.append(block_id)
        self.stats.pinned_blocks += len(pinned)
        return pinned

    def unpin(self, block_ids: Sequence[int]) -> None:
        """End these blocks' pins now (free ones go back to the free queue, most recently used)."""
        for block_id in block_ids:
            if self._pin_until.pop(block_id, None) is None:
                continue
            if self._free_pinned.pop(block_id, None) is not None:
                self._free[block_id] = None

    def _insert_pinned(self, block_id: int, until: float) -> None:
        last = next(reversed(self._free_pinned.values()), None) if self._free_pinned else None
        self._free_pinned[block_id] = until
        if last is None or last <= until:
            return  # pins mostly arrive in expiry order
        later = [b for b, u in self._free_pinned.items() if u > until]
        for b in later:
            self._free_pinned.move_to_end(b)

    def _expire_pins(self) -> None:
        now = self.clock()
        while self._free_pinned:
            block_id, until = next(iter(self._free_pinned.items()))
            if until > now:
                break
            del self._free_pinned[block_id]
            self._pin_until.pop(block_id, None)
            self._free[block_id] = None

    # -- prefix cache ----------------------------------------------------------------------
    def hash_blocks(self, token_ids: Sequence[int], num_full_blocks: int,
                    known: list[BlockHash] | None = None) -> list[BlockHash]:
        """Chained hashes of the first num_full_blocks blocks; ``known`` hashes are reused."""
        hashes = list(known or [])
        bs = self.block_size
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full_blocks):
            parent = self.hash_fn(parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            hashes.append(parent)
        return hashes

    def lookup(self, token_ids: Sequence[int], hashes: Sequence[BlockHash]) -> list[int]:
        """Longest run of cached blocks matching the leading full blocks of token_ids."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        for i, h in enumerate(hashes):
            block_id = self._cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tuple(token_ids[i * bs : (i + 1) * bs]):
                break  # hash collision: different tokens, never reuse
            hits.append(block_id)
        return hits

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference to cache-hit blocks, pulling free ones out of the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                if self._free_pinned.pop(block_id, None) is not None:
                    self.stats.pinned_hits += 1
                else:
                    del self._free[block_id]
            block.ref_count += 1

    def cache_block(self, block_id: int, block_hash: BlockHash, token_ids: tuple[int, ...],
                    parent_hash: BlockHash | None = None) -> None:
        """Register a full, computed block under its hash (first writer wins); ``parent_hash``:
        the hash of the block before it in its sequence (None for a first block)."""
        if not self.enable_prefix_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is already cached; this one stays private
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.parent_hash = parent_hash
        self._cached[block_hash] = block_id
        self._children.setdefault(parent_hash, {}).setdefault(token_ids[0], set()).add(block_id)
        if self.events is not None:
            self.events.stored(block_hash, parent_hash, token_ids, self.block_size)

    def first_divergence(self, token_ids: Sequence[int], num_hits: int, parent_hash: BlockHash | None) -> int:
        """The first token of ``token_ids`` past its ``num_hits`` cached leading blocks (the
        last with hash ``parent_hash``) that no cached block continuing that prefix holds at
        its place: the longest common start of the next block's tokens with any such block's."""
        bs = self.block_size
        start = num_hits * bs
        nxt = tuple(token_ids[start : start + bs])
        if not nxt:
            return start
        best = 0
        for block_id in self._children.get(parent_hash, {}).get(nxt[0], ()):
            cached = self.blocks[block_id].token_ids
            assert cached is not None
            n = 0
            while n < len(nxt) and cached[n] == nxt[n]:
                n += 1
            best = max(best, n)
            if best == len(nxt):
                break
        return start + best

    # -- draft-model K/V (speculative decoding) ---------------------------------------------
    def mark_draft_filled(self, block_ids: Sequence[int]) -> None:
        """These blocks now hold the draft model's K/V for all their tokens too."""
        for block_id in block_ids:
            self.blocks[block_id].draft_filled = True

    def num_draft_filled(self, block_ids: Sequence[int]) -> int:
        """How many leading blocks of ``block_ids`` hold the draft model's K/V."""
        n = 0
        while n < len(block_ids) and self.blocks[block_ids[n]].draft_filled:
            n += 1
        return n

    def check_consistency(self) -> None:
        """Raise if the pool's invariants do not hold (used by tests and debug checks)."""
        for block in self.blocks:
            where = [block.block_id in q for q in (self._free, self._free_pinned, self._reserved)]
            in_free = any(where)
            if (block.ref_count == 0) != in_free:
                raise AssertionError(f"block {block.block_id}: ref {block.ref_count}, in free queue {in_free}")
            if sum(where) > 1:
                raise AssertionError(f"block {block.block_id}: in more than one free queue")
            if block.block_id in self._reserved and block.block_hash is not None:
                raise AssertionError(f"block {block.block_id}: held back but cached")
            if block.ref_count < 0:
                raise AssertionError(f"block {block.block_id}: negative ref count")
            if (block.block_hash is None) != (block.token_ids is None):
                raise AssertionError(f"block {block.block_id}: hash and token ids out of step")
            if block.block_hash is not None and self._cached.get(block.block_hash) == block.block_id:
                assert block.token_ids is not None
                if block.block_id not in self._children.get(block.parent_hash, {}).get(block.token_ids[0], ()):
                    raise AssertionError(f"block {block.block_id}: cached but not indexed under its parent")
        for h, block_id in self._cached.items():
            if self.blocks[block_id].block_hash != h:
                raise AssertionError(f"cache entry for block {block_id} does not match its hash")
