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

Plain data: the scheduler builds it (``Scheduler.kv_figures``), the metrics read it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


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
    num_pinned_blocks: int = 0  # free blocks pinned after a tool call, kept the last to be evicted
    pinned_hits: int = 0  # pinned blocks taken as prefix-cache hits before their pin ended (cumulative)
    pinned_taken: int = 0  # pinned blocks handed out early because nothing else was free (cumulative)

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
