"""A Python model of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``)
that replays allocation traces, so the fragmentation a ``PYTORCH_CUDA_ALLOC_CONF`` setting
will cause can be predicted without a GPU.

The rules, as in the C++ source (each pinned by a unit test in tests/test_allocator_simulator.py):

- **Rounding**: sizes round up to 512 B; with ``roundup_power2_divisions`` N > 1 for the
  size's power-of-two interval (and size > 512 * N), to the next of N equal divisions of it.
- **Pools**: <= 1 MiB goes to the small pool, whose segments are 2 MiB; larger requests to
  the large pool, whose segments are 20 MiB for requests under 10 MiB, else the request
  rounded up to 2 MiB.
- **Best fit per stream**: the smallest cached free block of the same stream that is large
  enough (ties by address: the lowest); a block never serves another stream. Blocks >= ``max_split_size``
  never serve requests below it, and serve larger ones only if block < request +
  ``max_non_split_rounding``.
- **Splitting**: the rest of a block becomes a free block if it is >= 512 B (small pool) or,
  in the large pool, if the request is below ``max_split_size`` and the rest is > 1 MiB.
- **Freeing** merges a block with its free neighbours of the same segment.
- **A miss**: garbage collection (only with a memory fraction set and a
  ``garbage_collection_threshold``), a new segment, then (with ``max_split_size``) free
  oversize cached blocks and retry, then free every unsplit cached block and retry (counted
  in ``num_alloc_retries``), then out of memory.
- **Garbage collection**: while reserved is above threshold x allowed, release unsplit
  large-pool cached blocks whose age (pool searches since their last use) is at least the
  average age, in rounds.

**Expandable segments** (``expandable_segments:True``): one virtual address range per pool
and stream (about the device's memory), mapped to physical memory in pages (2 MiB small pool,
20 MiB large pool) as needed. A miss maps pages after the lowest free stretch that, with
the unmapped space after it, is big enough, so a freed block at the end of the mapped part
grows instead of a new segment being reserved; every block splits (a remainder >= 512 B);
best fit counts a block's unmapped space behind it as part of its size; releasing the cache
unmaps the whole free pages inside free blocks (partly used pages stay mapped), and a
segment with nothing mapped is released. Their free blocks are left out of
``inactive_split_bytes``, as PyTorch's statistics leave them out.

**Addresses**: each new segment is placed below the ones before it, as ``cudaMalloc`` placed
them on an H200 (torch 2.11, CUDA 13, driver 580; 2026-12-04). The order decides ties
between free blocks of equal size, and so which neighbours later merge: with rising
addresses the model missed the real peak by -2.3% and -12.2% on 2 of the 15 trace/setting
pairs of ``benchmarks/allocator_check.py``; with falling ones it matched all 15 exactly,
reserved and allocated bytes after every event of both misses.

Not modelled: CUDA-graph private pools, and cross-stream uses (``record_stream``) that
delay a free.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import pathlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from tailserve.errors import ConfigError
from tailserve.memory.allocator.conf import AllocatorConf, parse_alloc_conf
from tailserve.memory.allocator.ratios import peak_waste_ratio, stranded_ratio, unallocated_ratio

K_MIN_BLOCK = 512
K_SMALL_SIZE = 1 << 20
K_SMALL_BUFFER = 2 << 20
K_LARGE_BUFFER = 20 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20


class SimulatedOutOfMemory(Exception):
    """The modelled allocator could not serve a request at the given capacity."""


@dataclass(eq=False)
class Block:
    stream: int
    size: int
    addr: int
    small: bool
    allocated: bool = False
    requested: int = 0
    prev: Block | None = None
    next: Block | None = None
    gc_count: int = 0
    segment: ExpandableSegment | None = None  # set for blocks of an expandable segment
    mapped: bool = True  # False: an expandable segment's address space with no memory behind it

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def key(self) -> tuple[int, int, int]:
        return (self.stream, self.size, self.addr)


@dataclass(eq=False)
class ExpandableSegment:
    """One virtual address range of ``size`` bytes, mapped in pages of ``page`` bytes."""

    stream: int
    base: int
    size: int
    page: int


class _Pool:
    """Free blocks ordered by (stream, size, address), as the C++ std::set is; and the
    unmapped stretches of expandable segments, by (stream, address)."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[tuple[int, int, int]] = []
        self.blocks: dict[tuple[int, int, int], Block] = {}
        self.unmapped: list[tuple[int, int]] = []
        self.unmapped_blocks: dict[tuple[int, int], Block] = {}

    def insert_unmapped(self, b: Block) -> None:
        k = (b.stream, b.addr)
        bisect.insort(self.unmapped, k)
        self.unmapped_blocks[k] = b

    def remove_unmapped(self, b: Block) -> None:
        k = (b.stream, b.addr)
        i = bisect.bisect_left(self.unmapped, k)
        if i == len(self.unmapped) or self.unmapped[i] != k:
            raise RuntimeError(f"unmapped block {k} is not in the pool")
        del self.unmapped[i]
        del self.unmapped_blocks[k]

    def insert(self, b: Block) -> None:
        k = b.key()
        bisect.insort(self.keys, k)
        self.blocks[k] = b

    def remove(self, b: Block) -> None:
        k = b.key()
        i = bisect.bisect_left(self.keys, k)
        if i == len(self.keys) or self.keys[i] != k:
            raise RuntimeError(f"block {k} is not in the pool")
        del self.keys[i]
        del self.blocks[k]

    def lower_bound(self, stream: int, size: int) -> int:
        return bisect.bisect_left(self.keys, (stream, size, -1))

    def __iter__(self) -> Iterator[Block]:
        return iter([self.blocks[k] for k in self.keys])


@dataclass
class AllocatorStats:
    reserved_bytes: int = 0
    allocated_bytes: int = 0
    requested_bytes: int = 0
    peak_reserved_bytes: int = 0
    peak_allocated_bytes: int = 0
    num_segments: int = 0
    num_alloc_retries: int = 0
    num_ooms: int = 0


class CachingAllocatorSimulator:
    """``malloc(size, stream) -> Block`` and ``free(block)`` on one device of
    ``capacity_bytes``; ``memory_fraction`` as ``torch.cuda.set_per_process_memory_fraction``."""

    def __init__(self, conf: AllocatorConf | str | None = None, capacity_bytes: int = 80 << 30,
                 memory_fraction: float | None = None) -> None:
        self.conf = conf if isinstance(conf, AllocatorConf) else parse_alloc_conf(conf)
        self.expandable = self.conf.expandable_segments
        self.capacity = capacity_bytes
        self.set_fraction = memory_fraction is not None
        self.allowed = int(memory_fraction * capacity_bytes) if memory_fraction is not None else capacity_bytes
        self.small_pool, self.large_pool = _Pool(True), _Pool(False)
        self.stats = AllocatorStats()
        # Segment addresses, far enough apart never to touch, falling (module docstring).
        self._next_addr = itertools.count(1 << 62, -(1 << 40))

    # -- the rules ---------------------------------------------------------------------------
    def round_size(self, size: int) -> int:
        if size < K_MIN_BLOCK:
            return K_MIN_BLOCK
        divisions = self.conf.divisions_for(size)
        if divisions > 1 and size > K_MIN_BLOCK * divisions:  # 1 division: plain 512 B rounding
            return _roundup_power2_next_division(size, divisions)
        return K_MIN_BLOCK * -(-size // K_MIN_BLOCK)

    @staticmethod
    def allocation_size(size: int) -> int:
        """A new segment's size for a rounded request."""
        if size <= K_SMALL_SIZE:
            return K_SMALL_BUFFER
        if size < K_MIN_LARGE_ALLOC:
            return K_LARGE_BUFFER
        return K_ROUND_LARGE * -(-size // K_ROUND_LARGE)

    def should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or self.expandable:
            return remaining >= K_MIN_BLOCK
        return size < self.conf.max_split_size and remaining > K_SMALL_SIZE

    def _gc_enabled(self) -> bool:
        return self.set_fraction and self.conf.garbage_collection_threshold > 0.0

    def _get_free_block(self, pool: _Pool, stream: int, size: int) -> Block | None:
        if self._gc_enabled():
            for b in pool.blocks.values():
                b.gc_count += 1
        i = pool.lower_bound(stream, size)
        if i == len(pool.keys) or pool.keys[i][0] != stream:
            return None
        block = pool.blocks[pool.keys[i]]
        if block.segment is not None:
            # Best fit by the size a block can grow to: a free block with unmapped space
            # behind it counts that space too, so a tighter block further on may win.
            def grown(b: Block) -> int:
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

            j = i + 1
            while block.segment is not None and j < len(pool.keys) and pool.keys[j][0] == stream \
                    and grown(pool.blocks[pool.keys[j]]) < grown(block):
                block = pool.blocks[pool.keys[j]]
                j += 1
        max_split = self.conf.max_split_size
        if size < max_split and block.size >= max_split:
            return None  # an oversize block never serves a request below max_split_size
        if size >= max_split and block.size >= size + self.conf.max_non_split_rounding:
            return None
        block.gc_count = 0
        pool.remove(block)
        return block

    def _alloc_block(self, pool: _Pool, stream: int, alloc_size: int, is_retry: bool,
                     size: int = 0) -> Block | None:
        if is_retry:
            self.stats.num_alloc_retries += 1
        limit = self.allowed if self.set_fraction else self.capacity
        if self.set_fraction and self.stats.reserved_bytes + alloc_size > limit:
            return None  # checked with the classic segment size, expandable or not (as in C++)
        if self.expandable:
            return self._allocate_expandable(pool, stream, size)
        if self.stats.reserved_bytes + alloc_size > limit:
            return None
        self.stats.reserved_bytes += alloc_size
        self.stats.num_segments += 1
        self.stats.peak_reserved_bytes = max(self.stats.peak_reserved_bytes, self.stats.reserved_bytes)
        return Block(stream, alloc_size, next(self._next_addr), pool.small)

    def _release_block(self, pool: _Pool, block: Block) -> None:
        pool.remove(block)
        self.stats.reserved_bytes -= block.size
        self.stats.num_segments -= 1

    # -- expandable segments -------------------------------------------------------------------
    def _find_expandable(self, pool: _Pool, stream: int, size: int) -> Block:
        """The lowest-addressed free stretch (free mapped and unmapped blocks in a row) of at
        least ``size`` bytes, starting at an unmapped block or the free block just before it;
        else a new segment's whole unmapped range."""

        def free(b: Block | None) -> bool:
            return b is not None and not b.allocated

        i = bisect.bisect_left(pool.unmapped, (stream, -1))
        while i < len(pool.unmapped) and pool.unmapped[i][0] == stream:
            c = pool.unmapped_blocks[pool.unmapped[i]]
            if free(c.prev):
                c = c.prev
            room, b = 0, c
            while room < size and free(b):
                room += b.size
                b = b.next
            if room >= size:
                return c
            i += 1
        page = K_SMALL_BUFFER if pool.small else K_LARGE_BUFFER
        # PyTorch reserves about the device's memory (plus an eighth) of address space per segment.
        va = page * -(-(self.capacity + self.capacity // 8) // page)
        seg = ExpandableSegment(stream, next(self._next_addr), va, page)
        c = Block(stream, va, seg.base, pool.small, segment=seg, mapped=False)
        pool.insert_unmapped(c)
        self.stats.num_segments += 1
        return c

    def _map(self, pool: _Pool, block: Block, size: int) -> bool:
        """Map the pages covering the first ``size`` bytes of an unmapped block."""
        page = block.segment.page  # type: ignore[union-attr]
        mapped = min(block.size, page * -(-size // page))
        limit = self.allowed if self.set_fraction else self.capacity
        if self.stats.reserved_bytes + mapped > limit:
            return False  # no physical memory left to map
        pool.remove_unmapped(block)
        block.mapped = True
        if mapped < block.size:
            rest = Block(block.stream, block.size - mapped, block.addr + mapped, block.small, prev=block,
                         next=block.next, segment=block.segment, mapped=False)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = mapped
            pool.insert_unmapped(rest)
        self._merge_free_neighbours(pool, block)
        pool.insert(block)
        self.stats.reserved_bytes += mapped
        self.stats.peak_reserved_bytes = max(self.stats.peak_reserved_bytes, self.stats.reserved_bytes)
        return True

    def _allocate_expandable(self, pool: _Pool, stream: int, size: int) -> Block | None:
        c = self._find_expandable(pool, stream, size)
        if not c.mapped and not self._map(pool, c, min(c.size, size)):
            return None
        while c.size < size:  # a free mapped block followed by unmapped space: map some of it
            nxt = c.next
            assert nxt is not None and not nxt.mapped
            if not self._map(pool, nxt, min(size - c.size, nxt.size)):
                return None
            c = nxt  # it absorbed c when it was mapped
        pool.remove(c)
        return c

    def _unmap(self, pool: _Pool, block: Block) -> None:
        """Unmap the whole pages inside a free block; the partly used pages at its ends stay."""
        page = block.segment.page  # type: ignore[union-attr]
        base = block.segment.base  # type: ignore[union-attr]
        begin = base + page * -(-(block.addr - base) // page)
        end = base + page * ((block.addr + block.size - base) // page)
        if begin >= end:
            return
        pool.remove(block)
        if begin > block.addr:  # prev -> before (free, mapped) -> block
            before = Block(block.stream, begin - block.addr, block.addr, block.small, prev=block.prev, next=block,
                           segment=block.segment)
            if block.prev is not None:
                block.prev.next = before
            block.prev = before
            pool.insert(before)
        if block.addr + block.size > end:  # block -> after (free, mapped) -> next
            after = Block(block.stream, block.addr + block.size - end, end, block.small, prev=block, next=block.next,
                          segment=block.segment)
            if block.next is not None:
                block.next.prev = after
            block.next = after
            pool.insert(after)
        block.addr, block.size, block.mapped = begin, end - begin, False
        self.stats.reserved_bytes -= end - begin
        self._merge_free_neighbours(pool, block)
        pool.insert_unmapped(block)
        if block.prev is None and block.next is None:  # nothing mapped any more: release the range
            pool.remove_unmapped(block)
            self.stats.num_segments -= 1

    def _merge_free_neighbours(self, pool: _Pool, block: Block) -> None:
        """Absorb free neighbours of the same kind (mapped with mapped), as try_merge_blocks."""
        for neighbour in (block.prev, block.next):
            if neighbour is None or neighbour.allocated or neighbour.mapped != block.mapped:
                continue
            if neighbour.mapped:
                pool.remove(neighbour)
            else:
                pool.remove_unmapped(neighbour)
            if neighbour is block.prev:
                block.addr = neighbour.addr
                block.prev = neighbour.prev
                if block.prev is not None:
                    block.prev.next = block
            else:
                block.next = neighbour.next
                if block.next is not None:
                    block.next.prev = block
            block.size += neighbour.size

    def _release_available_cached_blocks(self, pool: _Pool, stream: int, size: int) -> bool:
        """Free oversize cached blocks (only with max_split_size): one large enough, else
        the largest ones of the stream until their sizes add up."""
        max_split = self.conf.max_split_size
        if math.isinf(max_split) or self.expandable:
            return False  # (PyTorch cannot release expandable blocks this way either)
        key_size = max(size, int(max_split))
        i = pool.lower_bound(stream, key_size)
        if i < len(pool.keys) and pool.keys[i][0] == stream:
            self._release_block(pool, pool.blocks[pool.keys[i]])
            return True
        if i == 0:
            return False
        released = 0
        j = i - 1
        while j >= 0 and released < key_size:
            b = pool.blocks[pool.keys[j]]
            if b.size < max_split or b.stream != stream:
                break
            released += b.size
            self._release_block(pool, b)
            j -= 1
        return released >= key_size

    def _release_cached_blocks(self) -> bool:
        for pool in (self.large_pool, self.small_pool):
            to_unmap = []
            for b in list(pool):
                if b.segment is not None:
                    to_unmap.append(b)
                elif not b.is_split:
                    self._release_block(pool, b)
            for b in to_unmap:
                self._unmap(pool, b)
        return True

    def _garbage_collect(self) -> None:
        threshold = int(self.conf.garbage_collection_threshold * self.allowed)
        if self.stats.reserved_bytes <= threshold:
            return
        target = self.stats.reserved_bytes - threshold
        freeable = [b for b in self.large_pool if not b.is_split and b.segment is None]
        if not freeable:
            return
        total_age = float(sum(b.gc_count for b in freeable))
        count = len(freeable)
        reclaimed, freed_any = 0, True
        while reclaimed < target and freed_any and count > 0:
            age_threshold = total_age / count
            freed_any = False
            for b in list(self.large_pool):
                if not b.is_split and b.segment is None and b.gc_count >= age_threshold:
                    freed_any = True
                    reclaimed += b.size
                    total_age -= b.gc_count
                    count -= 1
                    self._release_block(self.large_pool, b)

    # -- the API ---------------------------------------------------------------------------------
    def malloc(self, orig_size: int, stream: int = 0) -> Block:
        size = self.round_size(orig_size)
        pool = self.small_pool if size <= K_SMALL_SIZE else self.large_pool
        alloc_size = self.allocation_size(size)
        block = self._get_free_block(pool, stream, size)
        if block is None:
            if self._gc_enabled():
                self._garbage_collect()
            block = self._alloc_block(pool, stream, alloc_size, False, size)
            if block is None and self._release_available_cached_blocks(pool, stream, size):
                block = self._alloc_block(pool, stream, alloc_size, False, size)
            if block is None and self._release_cached_blocks():
                block = self._alloc_block(pool, stream, alloc_size, True, size)
        if block is None:
            self.stats.num_ooms += 1
            raise SimulatedOutOfMemory(
                f"tried to allocate {alloc_size} bytes with {self.stats.reserved_bytes} reserved and "
                f"{self.stats.allocated_bytes} allocated of {self.allowed if self.set_fraction else self.capacity}")
        if self.should_split(block, size):
            rest = Block(stream, block.size - size, block.addr + size, block.small, prev=None, next=block.next,
                         segment=block.segment)
            used = Block(stream, size, block.addr, block.small, prev=block.prev, next=rest, segment=block.segment)
            rest.prev = used
            if used.prev is not None:
                used.prev.next = used
            if rest.next is not None:
                rest.next.prev = rest
            pool.insert(rest)
            block = used
        block.allocated = True
        block.requested = orig_size
        st = self.stats
        st.allocated_bytes += block.size
        st.requested_bytes += orig_size
        st.peak_allocated_bytes = max(st.peak_allocated_bytes, st.allocated_bytes)
        return block

    def free(self, block: Block) -> None:
        if not block.allocated:
            raise RuntimeError("block freed twice")
        block.allocated = False
        self.stats.allocated_bytes -= block.size
        self.stats.requested_bytes -= block.requested
        pool = self.small_pool if block.small else self.large_pool
        self._merge_free_neighbours(pool, block)
        pool.insert(block)

    def empty_cache(self) -> None:
        self._release_cached_blocks()

    # -- figures ---------------------------------------------------------------------------------
    @property
    def inactive_split_bytes(self) -> int:
        """Free bytes in split blocks: stranded in segments that are partly in use (an
        expandable segment's free pages can be unmapped, so PyTorch leaves them out)."""
        return sum(b.size for pool in (self.small_pool, self.large_pool) for b in pool.blocks.values()
                   if b.is_split and b.segment is None)

    @property
    def largest_free_block(self) -> int:
        return max((b.size for pool in (self.small_pool, self.large_pool) for b in pool.blocks.values()), default=0)

    def fragmentation(self) -> dict[str, float]:
        """The three measures: inactive split / reserved (the one alerted on), (reserved -
        allocated) / reserved (includes releasable cache), 1 - peak allocated / peak reserved."""
        st = self.stats
        return {
            "inactive_split_over_reserved": stranded_ratio(self.inactive_split_bytes, st.reserved_bytes),
            "unallocated_over_reserved": unallocated_ratio(st.reserved_bytes, st.allocated_bytes),
            "one_minus_peak_ratio": peak_waste_ratio(st.peak_allocated_bytes, st.peak_reserved_bytes) or 0.0,
        }


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    if size <= 4 or divisions <= 1 or size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


# -- traces ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceEvent:
    action: str  # "alloc" | "free"
    addr: int
    size: int
    stream: int = 0


def read_jsonl_trace(path: str | pathlib.Path) -> list[TraceEvent]:
    """Lines of ``{"action": "alloc"|"free", "addr": int, "size": int, "stream": int}``."""
    events = []
    for n, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            ev = TraceEvent(str(d["action"]), int(d["addr"]), int(d.get("size", 0)), int(d.get("stream", 0)))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{path}:{n}: not a trace event ({e})") from None
        if ev.action not in ("alloc", "free"):
            raise ConfigError(f"{path}:{n}: action must be alloc or free, got {ev.action!r}")
        events.append(ev)
    return events


# The monitor's alert (allocator/monitor.py) replayed on a trace: the stranded measure above
# ALERT_THRESHOLD while reserved is at least the floor, for ALERT_TRIGGER evaluations in a row
# (the monitor's samples; here one after each event of the trace).
ALERT_THRESHOLD = 0.30
ALERT_MIN_RESERVED_BYTES = 1 << 30
ALERT_TRIGGER = 3


@dataclass
class SimulationResult:
    conf: str
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    num_alloc_retries: int
    oom: bool
    oom_at_event: int | None
    final_fragmentation: dict[str, float] = field(default_factory=dict)
    # inactive split / reserved at any moment, however little was reserved then (a ratio
    # taken with almost nothing allocated can read 1.0: read the next two instead).
    max_inactive_split_over_reserved: float = 0.0
    # The same measure when reserved last reached its peak: what stands between the
    # allocator and an out-of-memory at the high-water mark.
    stranded_at_peak: float = 0.0
    # The alert's view: the largest value while reserved >= alert_min_reserved_bytes, and
    # whether the monitor's alert (ALERT_THRESHOLD, ALERT_TRIGGER) would have fired.
    alert_min_reserved_bytes: int = ALERT_MIN_RESERVED_BYTES
    max_stranded_above_floor: float = 0.0
    alert_fires: bool = False

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def simulate_trace(events: Iterable[TraceEvent], conf: AllocatorConf | str | None = None,
                   capacity_bytes: int = 80 << 30, memory_fraction: float | None = None,
                   alert_min_reserved_bytes: int = ALERT_MIN_RESERVED_BYTES,
                   alert_threshold: float = ALERT_THRESHOLD) -> SimulationResult:
    """Replay a trace; frees of addresses the trace never allocated are ignored (a trace
    that starts mid-run)."""
    sim = CachingAllocatorSimulator(conf, capacity_bytes, memory_fraction)
    live: dict[int, Block] = {}
    oom_at = None
    worst = at_peak = above_floor = 0.0
    run = 0
    fires = False
    for i, ev in enumerate(events):
        if ev.action == "alloc":
            try:
                live[ev.addr] = sim.malloc(ev.size, ev.stream)
            except SimulatedOutOfMemory:
                oom_at = i
                break
        else:
            b = live.pop(ev.addr, None)
            if b is not None:
                sim.free(b)
        reserved = sim.stats.reserved_bytes
        if not reserved:
            run = 0
            continue
        ratio = sim.inactive_split_bytes / reserved
        worst = max(worst, ratio)
        if reserved == sim.stats.peak_reserved_bytes:
            at_peak = ratio
        if reserved >= alert_min_reserved_bytes:
            above_floor = max(above_floor, ratio)
            run = run + 1 if ratio > alert_threshold else 0
            fires = fires or run >= ALERT_TRIGGER
        else:
            run = 0
    return SimulationResult(str(sim.conf), sim.stats.peak_reserved_bytes, sim.stats.peak_allocated_bytes,
                            sim.stats.num_alloc_retries, oom_at is not None, oom_at, sim.fragmentation(), worst,
                            at_peak, alert_min_reserved_bytes, above_floor, fires)


RECOMMEND_CANDIDATES: tuple[str, ...] = (
    "", "max_split_size_mb:64", "max_split_size_mb:128", "max_split_size_mb:256", "max_split_size_mb:512",
    "roundup_power2_divisions:2", "roundup_power2_divisions:4", "roundup_power2_divisions:8",
    "max_split_size_mb:128,roundup_power2_divisions:4", "max_split_size_mb:256,roundup_power2_divisions:4",
    "max_split_size_mb:128,roundup_power2_divisions:8", "max_split_size_mb:512,roundup_power2_divisions:8",
    "expandable_segments:True",
)


def recommend(events: list[TraceEvent], capacity_bytes: int, memory_fraction: float | None = None,
              candidates: Iterable[str] = RECOMMEND_CANDIDATES) -> tuple[list[SimulationResult], str]:
    """Simulate every candidate; rank those that never run out by peak reserved bytes (then
    retries, then the simpler setting); returns (ranked results, a sentence saying why)."""
    results = [simulate_trace(events, c, capacity_bytes, memory_fraction) for c in candidates]
    ranked = sorted(results, key=lambda r: (r.oom, r.peak_reserved_bytes, r.num_alloc_retries, len(r.conf)))
    default = next(r for r in results if r.conf in ("", "default"))
    best = ranked[0]
    mib = 1 << 20
    if best.oom:
        why = (f"every candidate runs out of memory at {capacity_bytes / mib:.0f} MiB; the latest to run out is "
               f"{best.conf or 'default'} (event {best.oom_at_event})")
    elif best is default or (best.peak_reserved_bytes == default.peak_reserved_bytes and not default.oom):
        why = ("keep PyTorch's defaults: no candidate reserves less than their "
               f"{default.peak_reserved_bytes / mib:.0f} MiB at peak on this trace")
    else:
        saved = default.peak_reserved_bytes - best.peak_reserved_bytes
        tail = (f"; the default runs out at event {default.oom_at_event}" if default.oom else
                f", {saved / mib:.0f} MiB ({saved / default.peak_reserved_bytes:.0%}) less than the default")
        why = (f"use PYTORCH_CUDA_ALLOC_CONF={best.conf}: peak reserved {best.peak_reserved_bytes / mib:.0f} MiB "
               f"with {best.num_alloc_retries} retries{tail}")
    return ranked, why
