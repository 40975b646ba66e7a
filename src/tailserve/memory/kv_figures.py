"""The paged KV cache's figures at one moment: how full it is, how much of what is
allocated holds tokens, and what the prefix cache saves.

- block utilisation: blocks held by requests / all blocks;
- token utilisation: computed tokens of running requests / token slots of their blocks
  (a request's last block is partly empty, and blocks reserved for the step in flight or
  for speculative lookahead hold no computed token yet);
- internal fragmentation: 1 - token utilisation, the empty slots of allocated blocks, which
  is all the waste paging leaves (a contiguous reservation wastes max_model_len - length
  per sequence instead);
- prefix-cache hit rate by tokens (prompt tokens found cached / looked up) and by requests
  (admissions that found at least one cached block / admissions that looked), evictions of
  cached blocks, and preemptions.

Shared blocks (prefix hits, and the prompt blocks of parallel samples) count once per
block in the block figures and once per holder in the token figures, as each holder
attends to them; ``blocks_saved_by_sharing`` is what sharing saves right now: the blocks
the holders would need on their own beyond those allocated.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

from tailserve.engine.scheduler import Scheduler


@dataclass(frozen=True)
class KVCacheFigures:
    block_size: int
    num_blocks: int
    num_used_blocks: int
    num_cached_blocks: int  # free blocks that still hold a reusable prefix
    num_live_tokens: int
    num_allocated_slots: int
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    prefix_queries_requests: int
    prefix_hits_requests: int
    num_evictions: int
    num_preemptions: int
    bytes_per_block: int
    num_shared_blocks: int = 0  # used blocks held by more than one request
    num_block_references: int = 0  # sum of used blocks' holders
    num_forks: int = 0  # parallel samples forked from their prompt's first sample (cumulative)
    num_fork_shared_blocks: int = 0  # prompt blocks those forks shared instead of computing (cumulative)

    @property
    def block_utilization(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def token_utilization(self) -> float:
        return self.num_live_tokens / self.num_allocated_slots if self.num_allocated_slots else 0.0

    @property
    def internal_fragmentation(self) -> float:
        return 1.0 - self.token_utilization if self.num_allocated_slots else 0.0

    @property
    def prefix_hit_rate_tokens(self) -> float:
        return self.prefix_hits_tokens / self.prefix_queries_tokens if self.prefix_queries_tokens else 0.0

    @property
    def prefix_hit_rate_requests(self) -> float:
        return self.prefix_hits_requests / self.prefix_queries_requests if self.prefix_queries_requests else 0.0

    @property
    def wasted_bytes(self) -> int:
        """Bytes of allocated blocks' empty slots."""
        return (self.num_allocated_slots - self.num_live_tokens) * self.bytes_per_block // self.block_size

    @property
    def blocks_saved_by_sharing(self) -> int:
        return self.num_block_references - self.num_used_blocks

    @property
    def bytes_saved_by_sharing(self) -> int:
        return self.blocks_saved_by_sharing * self.bytes_per_block

    def as_dict(self) -> dict[str, float | int]:
        d: dict[str, float | int] = asdict(self)
        for name in ("block_utilization", "token_utilization", "internal_fragmentation", "prefix_hit_rate_tokens",
                     "prefix_hit_rate_requests", "wasted_bytes", "blocks_saved_by_sharing",
                     "bytes_saved_by_sharing"):
            d[name] = getattr(self, name)
        return d

    @classmethod
    def from_scheduler(cls, scheduler: Scheduler, bytes_per_block: int) -> KVCacheFigures:
        pool = scheduler.pool
        running = scheduler.running
        # Holders per block, from the requests (the pool's ref counts also include sources
        # held for a fork's pending copy).
        holders = Counter(b for r in scheduler.requests.values() for b in r.block_ids)
        ps = pool.stats
        return cls(
            block_size=pool.block_size, num_blocks=pool.num_blocks, num_used_blocks=pool.num_used_blocks,
            num_cached_blocks=sum(1 for b in pool.blocks if b.block_hash is not None and b.ref_count == 0),
            num_live_tokens=sum(r.num_computed_tokens for r in running),
            num_allocated_slots=sum(len(r.block_ids) for r in running) * pool.block_size,
            prefix_queries_tokens=ps.queries_tokens, prefix_hits_tokens=ps.hits_tokens,
            prefix_queries_requests=ps.queries_requests, prefix_hits_requests=ps.hits_requests,
            num_evictions=ps.evictions, num_preemptions=scheduler.num_preemptions, bytes_per_block=bytes_per_block,
            num_shared_blocks=sum(1 for n in holders.values() if n > 1),
            num_block_references=sum(holders.values()),
            num_forks=scheduler.num_forks, num_fork_shared_blocks=scheduler.num_fork_shared_blocks)
