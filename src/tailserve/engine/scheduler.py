"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

The scheduler only emits a ``SchedulerOutput`` (plain Python data: which requests, how many
new tokens each) and only takes a ``ModelRunnerOutput`` (sampled token ids per request). It
never touches a tensor, so it is unit-tested with hand-written outputs and no model.

Policy, per step, under ``max_num_batched_tokens`` and ``max_num_seqs``:
1. Running requests first, oldest first: a decode takes one token; an unfinished prefill
   takes the rest of its prompt, or as much as the token budget allows (chunked prefill).
   When the block pool cannot hold the new tokens, the most recently admitted running
   request is preempted: its blocks are freed and it goes back to the front of the queue,
   to be recomputed later (its cached prefix blocks usually make that cheap).
2. Then waiting requests, first come first served, each starting from its longest
   prefix-cache hit, while budget, sequence slots and free blocks last. No new request is
   admitted in a step that had to preempt.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tailserve.config import SchedulerConfig
from tailserve.engine.request import Request, RequestStatus
from tailserve.memory.block_pool import BlockPool


@dataclass
class ScheduledSeq:
    """One request's share of a step: compute ``token_ids`` at positions
    ``start_pos .. start_pos + len(token_ids) - 1``; sample a token after the last one if
    ``sample`` (the prompt is then fully computed)."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool
    is_prefill: bool
    num_draft_tokens: int = 0  # the last this-many token_ids are drafts to verify


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # finished since the previous step

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)


@dataclass
class RequestUpdate:
    """What one step did to one request, for the engine's output processing."""

    request: Request
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    finished: bool
    num_draft_tokens: int = 0
    num_accepted: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.block_size = pool.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_step: list[str] = []
        self.num_preemptions = 0

    # -- queue management -----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a request from outside a step (abort, or a stop string found in its text)."""
        req = self.requests.get(request_id)
        if req is None:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        if req.timeline is not None and req.timeline.finished_ns is None:
            req.timeline.finished_ns = time.perf_counter_ns()
        self._release(req)

    def _release(self, req: Request) -> None:
        self.pool.free(req.block_ids)
        req.block_ids = []
        self.requests.pop(req.request_id, None)
        self._finished_since_step.append(req.request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- scheduling -------------------------------------------------------------------------
    def _blocks_needed(self, req: Request, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size) - len(req.block_ids)

    def _try_allocate(self, req: Request, num_new: int) -> bool:
        need = self._blocks_needed(req, req.num_computed_tokens + num_new)
        if need > self.pool.num_free_blocks:
            return False
        if need > 0:
            req.block_ids.extend(self.pool.allocate(need))
        return True

    def reserve(self, req: Request, num_tokens: int) -> bool:
        """Make req's blocks cover num_tokens positions now (for draft look-ahead)."""
        return self._try_allocate(req, num_tokens - req.num_computed_tokens)

    def _preempt(self, req: Request, now_ns: int) -> None:
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.spec_token_ids = []
        req.num_draft_seen = req.num_draft_marked = 0
        req.num_registered_blocks = 0
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        if req.timeline is not None:
            req.timeline.preempted_ns.append(now_ns)
        self.waiting.appendleft(req)

    def schedule(self, now_ns: int | None = None) -> SchedulerOutput:
        now_ns = time.perf_counter_ns() if now_ns is None else now_ns
        out = SchedulerOutput(finished_ids=self._finished_since_step)
        self._finished_since_step = []
        budget = self.config.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens + len(req.spec_token_ids), budget)
            preempted_self = False
            while not self._try_allocate(req, num_new):
                victim = self.running.pop()
                self._preempt(victim, now_ns)
                out.preempted_ids.append(victim.request_id)
                if victim is req:
                    preempted_self = True
                    break
            if preempted_self:
                break
            out.scheduled.append(self._scheduled_seq(req, num_new))
            budget -= num_new
            i += 1

        if not out.preempted_ids:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                hits = self._prefix_hits(req)
                num_computed = len(hits) * self.block_size
                num_new = req.num_tokens - num_computed
                if num_new > budget and not self.config.enable_chunked_prefill:
                    break
                num_new = min(num_new, budget)
                # Cache-hit blocks that are currently free stop being free when taken.
                free_hits = sum(1 for b in hits if self.pool.blocks[b].ref_count == 0)
                need = -(-(num_computed + num_new) // self.block_size) - len(hits)
                if need > self.pool.num_free_blocks - free_hits:
                    break
                self.waiting.popleft()
                self.pool.touch(hits)
                req.block_ids = list(hits)
                req.num_computed_tokens = num_computed
                # The draft's K/V is reusable for the leading hit blocks that it filled.
                filled = 0
                while filled < len(hits) and self.pool.blocks[hits[filled]].draft_filled:
                    filled += 1
                req.num_draft_seen = min(num_computed, filled * self.block_size)
                req.num_draft_marked = 0
                req.num_registered_blocks = len(hits)
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_computed
                self.pool.stats.queries_tokens += req.num_tokens
                self.pool.stats.hits_tokens += num_computed
                req.block_ids.extend(self.pool.allocate(need))
                req.status = RequestStatus.RUNNING
                if req.timeline is not None:
                    req.timeline.on_scheduled(now_ns)
                self.running.append(req)
                out.scheduled.append(self._scheduled_seq(req, num_new))
                budget -= num_new
        return out

    def _prefix_hits(self, req: Request) -> list[int]:
        if not self.pool.enable_prefix_caching:
            return []
        # At least one token must be computed to get logits, so the last token never hits.
        eligible = (req.num_tokens - 1) // self.block_size
        req.block_hashes = self.pool.hash_blocks(req.all_token_ids, eligible, known=req.block_hashes[:eligible])
        return self.pool.lookup(req.all_token_ids, req.block_hashes[:eligible])

    def _scheduled_seq(self, req: Request, num_new: int) -> ScheduledSeq:
        start = req.num_computed_tokens
        n_real = min(num_new, req.num_tokens - start)
        end = start + n_real
        drafts = req.spec_token_ids[: num_new - n_real]
        req.spec_token_ids = []  # consumed: verified this step, or dropped for lack of budget
        return ScheduledSeq(
            request_id=req.request_id,
            token_ids=req.all_token_ids[start:end] + drafts,
            start_pos=start,
            block_ids=req.block_ids,
            sample=end == req.num_tokens,
            is_prefill=end <= req.num_prompt_tokens or (n_real > 1),
            num_draft_tokens=len(drafts),
        )

    # -- results ---------------------------------------------------------------------------
    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput, now_ns: int | None = None
               ) -> list[RequestUpdate]:
        now_ns = time.perf_counter_ns() if now_ns is None else now_ns
        updates = []
        for seq in sched.scheduled:
            req = self.requests.get(seq.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished (aborted) while the step ran
            if not seq.sample:
                req.num_computed_tokens += len(seq.token_ids)
                self._register_full_blocks(req)
                continue
            new_ids = result.sampled_token_ids.get(req.request_id, [])
            k = seq.num_draft_tokens
            num_acc = max(len(new_ids) - 1, 0) if k else 0
            # Roll back the rejected drafts: their K/V slots hold garbage and are simply
            # overwritten later; only accepted tokens count as computed (and get cached).
            req.num_computed_tokens += len(seq.token_ids) - (k - num_acc)
            if k:
                req.spec_num_drafts += 1
                req.spec_num_draft_tokens += k
                req.spec_num_accepted_tokens += num_acc
            accepted: list[int] = []
            finished = False
            for tok in new_ids:
                accepted.append(tok)
                if req.append_output(tok):
                    finished = True
                    break
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
            self._register_full_blocks(req)
            if req.timeline is not None:
                req.timeline.on_tokens(now_ns, len(accepted))
                if finished:
                    req.timeline.finished_ns = now_ns
            lps = result.logprobs.get(req.request_id)
            updates.append(RequestUpdate(req, accepted, lps[: len(accepted)] if lps else None, finished,
                                         k, num_acc))
            if finished:
                self.running.remove(req)
                self._release(req)
        return updates

    def _register_full_blocks(self, req: Request) -> None:
        """Offer newly completed (full, computed) blocks to the prefix cache."""
        if not self.pool.enable_prefix_caching:
            return
        full = req.num_computed_tokens // self.block_size
        if full <= req.num_registered_blocks:
            return
        req.block_hashes = self.pool.hash_blocks(req.all_token_ids, full, known=req.block_hashes[:full])
        bs = self.block_size
        for b in range(req.num_registered_blocks, full):
            self.pool.cache_block(req.block_ids[b], req.block_hashes[b],
                                  tuple(req.all_token_ids[b * bs : (b + 1) * bs]))
        req.num_registered_blocks = full
