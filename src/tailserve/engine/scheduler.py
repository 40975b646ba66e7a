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
   admitted in a step that had to preempt. With ``max_num_partial_prefills`` (vLLM V0's
   flag; the CPU server's default is 2), a request with more than one token to compute
   waits while that many prefills already run this step; with ``max_long_partial_prefills``
   (the same; 1 there), one with more than ``long_prefill_token_threshold`` tokens to
   compute waits while that many long prefills do. Where a step's time grows with its
   prompt tokens (the CPU), a burst prefilled in one step makes every request in it wait for
   all of them, and prompts that start together with equal lengths finish together: a burst
   stays a burst, wave after wave. A few prefills a step spread it, and it stays spread (2
   AVX2 cores, the built-in target, 64 x 128/128 at 16 concurrent, repeated prompts leaving
   16 tokens each to compute: TTFT P50 ~25 ms with one a step, ~30 ms with two, ~45 ms with
   five, ~60 ms with sixteen).
3. With speculative decoding, the scheduler owns the round: it schedules the draft tokens
   proposed last step for verification, chooses how many to propose after this step (the
   adaptive controller's k, for every request: a seeded one's output does not depend on k)
   and reserves their KV slots now, while free blocks last (a request
   that cannot get them drafts nothing this round; nobody is preempted for a draft).
   The worker returns the drafts in ``ModelRunnerOutput``; the draft model's K/V reuse on
   prefix hits is recorded through the block pool's own API.
4. Parallel sampling (``n`` > 1, ``best_of``): the samples of one prompt form a fork group.
   Only the first is queued; the others wait until its prompt is computed and are then
   forked from it, as PagedAttention does: they take a reference to every prompt block
   before the one holding the last prompt token (shared, read-only from then on), and get
   a private copy of that block (copy-on-write: it is the first block a sample writes,
   since each sample recomputes the last prompt token to sample its own first token). The
   copies travel in the next ``SchedulerOutput`` (``block_copies``); the worker makes them
   before that step's forward. A sample that finds no free block or sequence slot at fork
   time is queued as an ordinary request instead.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, deque
from typing import TYPE_CHECKING

from tailserve.config import SchedulerConfig
from tailserve.engine.request import Request, RequestStatus
from tailserve.engine.scheduler_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
    StepCost,
    verified,
)
from tailserve.memory.block_pool import BlockPool
from tailserve.memory.kv_figures import KVCacheFigures
from tailserve.speculative.adaptive import AdaptiveSpeculation, BatchOutlook, SloState
from tailserve.speculative.stats import SpecDecodeStats

if TYPE_CHECKING:
    from tailserve.speculative.suffix import SuffixCacheFigures


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool,
                 speculation: AdaptiveSpeculation | None = None) -> None:
        self.config = config
        self.pool = pool
        self.block_size = pool.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_step: list[str] = []
        self._preempted_since_step: list[str] = []
        self.num_preemptions = 0
        self.suffix_cache: SuffixCacheFigures | None = None  # the worker's last report (suffix decoding)
        # Fork groups: copies owed to the worker (source, destination); each source block is
        # referenced until the copy is sent, so it cannot be reused before it is read.
        self._pending_copies: list[tuple[int, int]] = []
        self.num_forks = 0  # samples forked from their group's first
        self.num_fork_shared_blocks = 0  # prompt blocks they shared instead of computing
        self.num_fork_copied_blocks = 0  # blocks copied on write at a fork
        # Finished requests whose blocks are pinned (``_pin``): id -> (block ids, expiry).
        self._kv_pins: dict[str, tuple[list[int], float]] = {}
        self._pin_refs: Counter[int] = Counter()  # per block: how many entries of _kv_pins hold it
        # Speculative decoding (None: off). Every request takes the controller's k, seeded ones
        # too: their tokens are their races' winners whatever k is (sample/sampler.py).
        self.speculation = speculation
        self.spec_stats = SpecDecodeStats()

    def kv_figures(self, bytes_per_block: int) -> KVCacheFigures:
        """The KV cache's figures now (a pass over the blocks and the requests)."""
        pool = self.pool
        running = self.running
        # Holders per block, from the requests (the pool's ref counts also include sources
        # held for a fork's pending copy).
        holders = Counter(b for r in self.requests.values() for b in r.block_ids)
        ps = pool.stats
        return KVCacheFigures(
            block_size=pool.block_size, num_blocks=pool.num_blocks, num_used_blocks=pool.num_used_blocks,
            num_cached_blocks=sum(1 for b in pool.blocks if b.block_hash is not None and b.ref_count == 0),
            num_live_tokens=sum(r.num_computed_tokens for r in running),
            num_allocated_slots=sum(len(r.block_ids) for r in running) * pool.block_size,
            prefix_queries_tokens=ps.queries_tokens, prefix_hits_tokens=ps.hits_tokens,
            prefix_queries_requests=ps.queries_requests, prefix_hits_requests=ps.hits_requests,
            num_evictions=ps.evictions, num_preemptions=self.num_preemptions, bytes_per_block=bytes_per_block,
            num_shared_blocks=sum(1 for n in holders.values() if n > 1),
            num_block_references=sum(holders.values()),
            num_forks=self.num_forks, num_fork_shared_blocks=self.num_fork_shared_blocks,
            num_pinned_blocks=pool.num_pinned_free_blocks, pinned_hits=ps.pinned_hits, pinned_taken=ps.pinned_taken)

    # -- queue management -----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if not request.arrival_ns:
            request.arrival_ns = time.perf_counter_ns()
        self.waiting.append(request)

    def add_fork_group(self, first: Request, others: list[Request]) -> None:
        """Samples of one prompt: ``first`` is queued; ``others`` are forked from it once its
        prompt is computed (the module docstring, point 4)."""
        ids = [first.request_id, *(r.request_id for r in others)]
        taken = [i for i in ids if i in self.requests]
        if taken or len(set(ids)) != len(ids):
            raise ValueError(f"request id {(taken or ids)[0]!r} is already in use")
        if any(r.prompt_token_ids != first.prompt_token_ids for r in others):
            raise ValueError("a fork group's samples must share one prompt")
        self.add_request(first)
        for r in others:
            self.requests[r.request_id] = r
            r.fork_parent = first
        first.fork_children = list(others)

    def finish_request(self, request_id: str, status: RequestStatus) -> list[tuple[str, int]]:
        """End a request from outside a step (abort, or a stop string found in its text).
        Returns its timeline events not yet reported."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.fork_parent is not None:  # still waiting to be forked
            req.fork_parent.fork_children.remove(req)
            req.fork_parent = None
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self._release(req)
        events, req.events = req.events, []
        return events

    def _pin(self, req: Request) -> None:
        """A request that may come back with the same prefix (an agent's turn that may end in a
        tool call): its cached blocks are the last to be evicted for ``kv_pin_s`` seconds,
        unless ``unpin`` says the answer was final."""
        now = self.pool.clock()
        # Pins are kept in the order they were made; with one TTL per server that is expiry order.
        while self._kv_pins:
            rid, (_, until) = next(iter(self._kv_pins.items()))
            if until > now:
                break
            self._drop_pin(rid)  # expired: the pool let its blocks go already
        pinned = self.pool.pin(req.block_ids, req.kv_pin_s)
        if pinned:  # the cached ones (a last partial block has nothing to keep, and is reused at once)
            self._kv_pins[req.request_id] = (pinned, now + req.kv_pin_s)
            self._pin_refs.update(pinned)

    def _drop_pin(self, request_id: str) -> list[int]:
        """Forget a request's pin; returns its blocks that no other live pin holds."""
        blocks, _ = self._kv_pins.pop(request_id)
        self._pin_refs.subtract(blocks)
        alone = [b for b in blocks if self._pin_refs[b] <= 0]
        for b in alone:
            del self._pin_refs[b]
        return alone

    def unpin(self, request_id: str) -> None:
        """End a finished request's pin (its answer was not a tool call). Blocks another pin
        holds too (a shared system prompt) stay pinned for it."""
        if request_id in self._kv_pins:
            self.pool.unpin(self._drop_pin(request_id))

    def _release(self, req: Request) -> None:
        if req.fork_children:
            # Finished before its prompt was shared (aborted, or in the step that computed it
            # with nowhere to fork): the other samples start on their own, next in line.
            for child in req.fork_children:
                child.fork_parent = None
            self.waiting.extendleft(reversed(req.fork_children))
            req.fork_children = []
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.grammar = None  # a finished request's matcher state goes with it
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

    def _try_allocate(self, req: Request, num_tokens: int) -> bool:
        """Make req's blocks cover its first num_tokens positions."""
        need = self._blocks_needed(req, num_tokens)
        if need > self.pool.num_free_blocks:
            return False
        if need > 0:
            req.block_ids.extend(self.pool.allocate(need, req.block_ids[-1] if req.block_ids else None))
        return True

    def _preempt(self, req: Request, now_ns: int) -> None:
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.spec_token_ids = []
        req.num_draft_marked = 0
        req.num_registered_blocks = 0
        req.num_computed_tokens = 0
        req.num_sent_blocks = None
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.events.append(("preempted", now_ns))
        self.waiting.appendleft(req)

    def preempt_after_failed_step(self, sched: SchedulerOutput, now_ns: int) -> list[str]:
        """A step ran out of device memory: preempt the newest half (at least one) of the
        requests it scheduled, so the next step asks for less. Nothing of the failed step was
        applied (``update`` never ran), so the others simply run it again; the worker drops
        the victims' state when the next step's ``preempted_ids`` reach it."""
        scheduled = {s.request_id for s in sched.scheduled}
        mine = [r for r in reversed(self.running) if r.request_id in scheduled]
        victims = mine[: max(1, len(mine) // 2)]
        for v in victims:
            self.running.remove(v)
            self._preempt(v, now_ns)
            self._preempted_since_step.append(v.request_id)
        return [v.request_id for v in victims]

    def schedule(self, now_ns: int | None = None) -> SchedulerOutput:
        now_ns = time.perf_counter_ns() if now_ns is None else now_ns
        out = SchedulerOutput(finished_ids=self._finished_since_step, block_copies=self._pending_copies)
        self._finished_since_step = []
        # The worker copies before this step's forward, so the sources may be reused from now on.
        self.pool.free([src for src, _ in self._pending_copies])
        self._pending_copies = []
        # Preempted outside a schedule (an out-of-memory step): the worker must hear of it,
        # and nothing new is admitted this step.
        out.preempted_ids.extend(self._preempted_since_step)
        self._preempted_since_step = []
        budget = self.config.max_num_batched_tokens
        chosen: list[Request] = []
        long_limit = self.config.max_long_partial_prefills
        num_long = 0  # long prefills given tokens this step
        prefill_limit = self.config.max_num_partial_prefills
        num_prefills = 0  # requests given more than one token to compute this step (prefills)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens + len(req.spec_token_ids), budget)
            if long_limit:
                num_long += self._is_long_prefill(req, req.num_computed_tokens)
            if prefill_limit:
                num_prefills += req.num_tokens - req.num_computed_tokens > 1  # a decode has one token to compute
            preempted_self = False
            while not self._try_allocate(req, req.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim, now_ns)
                out.preempted_ids.append(victim.request_id)
                if victim is req:
                    preempted_self = True
                    break
            if preempted_self:
                break
            out.scheduled.append(self._scheduled(req, num_new))
            chosen.append(req)
            budget -= num_new
            i += 1

        if not out.preempted_ids:
            reserve = self._admission_reserve() if self.waiting else 0
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                hits = self._prefix_hits(req)
                num_computed = len(hits) * self.block_size
                num_new = req.num_tokens - num_computed
                if num_new > budget and not self.config.enable_chunked_prefill:
                    break
                is_long = bool(long_limit) and self._is_long_prefill(req, num_computed)
                if is_long and num_long >= long_limit:
                    break  # first come, first served: it waits for the long prefill ahead of it
                if prefill_limit and num_new > 1 and num_prefills >= prefill_limit:
                    break  # the same, for the prefills ahead of it
                num_prefills += num_new > 1
                num_new = min(num_new, budget)
                # Cache-hit blocks that are currently free stop being free when taken.
                free_hits = sum(1 for b in hits if self.pool.blocks[b].ref_count == 0)
                need = self._blocks_at_admission(req, num_computed + num_new) - len(hits)
                grows = self._growth_blocks(req, len(hits) + need)  # its own growth must fit too
                # Alone, a request is admitted whatever its growth: nothing else could free blocks.
                if need + (grows + reserve if self.running else 0) > self.pool.num_free_blocks - free_hits:
                    break
                self.waiting.popleft()
                self.pool.touch(hits)
                req.block_ids = list(hits)
                req.num_computed_tokens = num_computed
                # The draft's K/V is reusable for the leading hit blocks that it filled.
                req.num_draft_cached_tokens = min(num_computed, self.pool.num_draft_filled(hits) * self.block_size)
                req.num_draft_marked = 0
                req.num_draft_seen_tokens = 0  # a resumed request's draft state went with its preemption
                req.num_registered_blocks = len(hits)
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_computed
                    req.prefix_break_token = self._prefix_break(req, len(hits))
                ps = self.pool.stats
                ps.queries_tokens += req.num_tokens
                ps.hits_tokens += num_computed
                if self.pool.enable_prefix_caching:
                    ps.queries_requests += 1
                    ps.hits_requests += num_computed > 0
                req.block_ids.extend(self.pool.allocate(need, hits[-1] if hits else None))
                req.status = RequestStatus.RUNNING
                req.events.append(("scheduled", now_ns))
                self.running.append(req)
                out.scheduled.append(self._scheduled(req, num_new))
                chosen.append(req)
                budget -= num_new
                reserve += grows
                num_long += is_long

        if self.speculation is not None and out.scheduled:
            self._reserve_lookahead(out, chosen)
        for req in chosen:
            self._describe(req, out)
        return out

    def _is_long_prefill(self, req: Request, num_computed: int) -> bool:
        """Whether ``req`` still has more than the long-prefill threshold of its prompt (or, after
        a preemption, of its context) to compute."""
        return req.num_tokens - num_computed > self.config.long_prefill_token_threshold

    def _growth_blocks(self, req: Request, held: int | None = None) -> int:
        """Blocks ``req`` lacks, beyond the ``held`` it has (default: its block table), for the
        rest of its prompt and its next ``admission_reserve_tokens`` tokens (at most what
        max_tokens and the context leave)."""
        n = self.config.admission_reserve_tokens
        if n <= 0:
            return 0
        grow = max(0, min(n, req.params.max_tokens - req.num_output_tokens, req.max_model_len - req.num_tokens))
        held = len(req.block_ids) if held is None else held
        return max(0, -(-(req.num_tokens + grow) // self.block_size) - held)

    def _admission_reserve(self) -> int:
        """Free blocks a new request may not take: the running requests' growth (SGLang
        reserves the same way, for a fraction of every running request's remaining tokens;
        vLLM V1 keeps none and preempts). Without it, a full pool admitted requests whose
        growth then preempted others, and each preemption recomputes its whole context."""
        return sum(self._growth_blocks(r) for r in self.running)

    def _blocks_at_admission(self, req: Request, num_tokens: int) -> int:
        """Blocks a request holds once admitted to compute its first ``num_tokens`` tokens.
        Paging allocates only those; the capacity benchmark's contiguous baseline overrides
        this to reserve the whole context up front."""
        return -(-num_tokens // self.block_size)

    def _outlook(self, out: SchedulerOutput, chosen: list[Request]) -> BatchOutlook:
        """The step's sampling requests: the most tokens one may still generate, and the
        tokens of their contexts that a draft model has not seen (its catch-up: the speculation
        policy weighs a bucket's first exploration by them). A request that drafted in another
        bucket (a batch whose requests finish apart leaves tails of 1-3) has its draft in step
        but for the tokens generated since its last proposal. And how many requests wait for a
        slot (they take the ones these free)."""
        remaining, unseen = 0, 0
        for s, req in zip(out.scheduled, chosen):
            if s.sample:
                remaining = max(remaining, min(req.params.max_tokens - req.num_output_tokens,
                                               req.max_model_len - req.num_tokens))
                seen = max(req.num_draft_seen_tokens, min(req.num_computed_tokens, req.num_draft_cached_tokens))
                unseen += max(req.num_tokens - seen, 0)
        return BatchOutlook(remaining, unseen, len(self.waiting))

    def _reserve_lookahead(self, out: SchedulerOutput, chosen: list[Request]) -> None:
        """Choose each sampling request's number of drafts to propose after this step and
        reserve their KV slots (the draft model writes K/V for them during the proposal)."""
        spec = self.speculation
        assert spec is not None
        num_decoding, greedy, decode_only = 0, True, True
        for s, req in zip(out.scheduled, chosen):
            if s.sample:
                num_decoding += 1
                greedy = greedy and req.params.greedy
            decode_only = decode_only and not s.is_prefill
        if decode_only and num_decoding and spec.take_quiet_step(num_decoding, greedy):
            return  # one more quiet step of k = 0 (out.spec_round stays None): nothing to decide
        if spec.hold_beside_prompts and spec.fixed_k is None and self._prompt_next(out, chosen):
            return  # a lookup drafts nothing beside a prompt's chunk (out.spec_round stays None)
        # Both built only where the policy reads them (the SLO state cost ~16 us a step at batch
        # 8, 2 AVX2 cores, read only by a goodput decision, not by a held or ruled-out bucket).
        slo_state = (lambda: self._slo_state(out, chosen)) if spec.objective == "goodput" else None
        k = spec.choose_k(num_decoding, slo_state, greedy, lambda: self._outlook(out, chosen),
                          decode_only) if num_decoding else 0
        if num_decoding:
            out.spec_round = spec.last_round  # None: a quiet step, not measured
        if k <= 0:
            return  # speculation off this step: nothing to reserve (the common step where it does not pay)
        for idx, (s, req) in enumerate(zip(out.scheduled, chosen)):
            if not s.sample:
                continue
            p = req.params
            if p.has_logits_processors:
                continue  # penalties depend on each verified position's history: no drafts
            # room_for_drafts before this step's tokens: an upper bound (the update trims).
            kk = min(k, req.room_for_drafts)
            if kk <= 0:
                continue
            # The step adds at most num_tokens + 1 tokens; the chain then writes K/V up to
            # kk - 1 positions past the last of them.
            if not self._try_allocate(req, s.start_pos + s.num_tokens + kk):
                continue
            out.scheduled[idx] = dataclasses.replace(s, num_lookahead_tokens=kk)

    def _prompt_next(self, out: SchedulerOutput, chosen: list[Request]) -> bool:
        """Whether the next step will likely compute prompt tokens: a prompt this step leaves
        unfinished, or a waiting request with a free slot to take (blocks permitting)."""
        if self.waiting and len(self.running) < self.config.max_num_seqs:
            return True
        return any(s.start_pos + s.num_tokens < req.num_prompt_tokens for s, req in zip(out.scheduled, chosen))

    def _slo_state(self, out: SchedulerOutput, chosen: list[Request]) -> SloState:
        """Per decoding request its decode so far and the most tokens it may still generate;
        per request without a first token (in this step's prefill, then the queue in order)
        its age; the slots the batch has free. Requests that get their first token this step
        count as waiting: this step's length is in their TTFT. A queued request preempted
        after its first token is judged by its TPOT (``SloState.waiting_decoded``)."""
        now = time.perf_counter_ns()
        elapsed, tokens, ages, remaining = [], [], [], []
        for req in chosen:
            if req.first_token_ns:
                elapsed.append((now - req.first_token_ns) * 1e-9)
                tokens.append(req.num_output_tokens - 1)
                remaining.append(min(req.params.max_tokens - req.num_output_tokens,
                                     req.max_model_len - req.num_tokens))
            else:
                ages.append((now - req.arrival_ns) * 1e-9)
        prefilling = len(ages)
        decoded: list[tuple[float, int] | None] = [None] * prefilling
        for req in self.waiting:
            ages.append((now - req.arrival_ns) * 1e-9)
            decoded.append(((now - req.first_token_ns) * 1e-9, req.num_output_tokens - 1) if req.first_token_ns
                           else None)
        free = max(self.config.max_num_seqs - len(self.running), 0)
        return SloState(tuple(elapsed), tuple(tokens), tuple(ages), prefilling, free, tuple(sorted(remaining)),
                        tuple(decoded) if any(decoded) else ())

    def _describe(self, req: Request, out: SchedulerOutput) -> None:
        """The request's data for the worker: all of it once, then the new block ids."""
        if req.num_sent_blocks is None:
            out.new_requests.append(NewRequestData(
                req.request_id, tuple(req.all_token_ids), req.num_prompt_tokens, req.params, tuple(req.block_ids),
                req.num_computed_tokens, req.num_draft_cached_tokens))
        else:
            out.cached_requests.append(CachedRequestData(
                req.request_id, tuple(req.block_ids[req.num_sent_blocks :]), req.num_computed_tokens))
        req.num_sent_blocks = len(req.block_ids)

    def _prefix_hits(self, req: Request) -> list[int]:
        # A request that wants its prompt's logprobs needs logits at every prompt position,
        # so none of its prompt may come from the cache (as vLLM).
        if not self.pool.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return []
        # At least one token must be computed to get logits, so the last token never hits.
        eligible = (req.num_tokens - 1) // self.block_size
        req.block_hashes = self.pool.hash_blocks(req.all_token_ids, eligible, known=req.block_hashes[:eligible])
        return self.pool.lookup(req.all_token_ids, req.block_hashes[:eligible])

    def _prefix_break(self, req: Request, num_hits: int) -> int:
        """At first admission: the first prompt token no cached block holds at its place
        (the prompt's length for a full hit; -1 when the cache was not looked up)."""
        if not self.pool.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return -1
        if num_hits >= (req.num_prompt_tokens - 1) // self.block_size:
            return req.num_prompt_tokens  # every block the cache could give was cached
        parent = req.block_hashes[num_hits - 1] if num_hits else None
        return self.pool.first_divergence(req.all_token_ids[: req.num_prompt_tokens], num_hits, parent)

    def _scheduled(self, req: Request, num_new: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        n_real = min(num_new, req.num_tokens - start)
        end = start + n_real
        drafts = tuple(req.spec_token_ids[: num_new - n_real])
        req.spec_token_ids = []  # consumed: verified this step, or dropped for lack of budget
        return ScheduledRequest(
            request_id=req.request_id,
            start_pos=start,
            num_tokens=num_new,
            draft_token_ids=drafts,
            sample=end == req.num_tokens,
            is_prefill=end <= req.num_prompt_tokens or (n_real > 1),
        )

    # -- results ---------------------------------------------------------------------------
    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput,
               last_step: StepCost | None = None) -> list[EngineCoreOutput]:
        """Apply a step's results. Everything the speculation policy learns comes in here: the
        acceptance of each verified round, the proposal's cost per draft step (``result``) and
        the previous decode step's whole cost (``last_step``, measured by the engine core once
        its outputs were processed). ``schedule`` then reads only the policy's state."""
        outputs = []
        spec = self.speculation
        if spec is not None and last_step is not None:
            fwd = last_step.target_forward_s
            if last_step.decode_only:
                spec.observe_step(last_step.num_tokens, fwd, max(last_step.total_s - fwd - last_step.propose_s, 0.0))
            if last_step.spec_round is not None:
                spec.observe_throughput(last_step.num_emitted, last_step.total_s, *last_step.spec_round,
                                        num_rounds=last_step.num_rounds, num_accepted=last_step.num_accepted,
                                        decode_only=last_step.decode_only, propose_s=last_step.propose_s,
                                        computed_tokens=last_step.num_tokens)
        for seq in sched.scheduled:
            req = self.requests.get(seq.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished (aborted) while the step ran
            if not seq.sample:
                req.num_computed_tokens += seq.num_tokens
                self._register_full_blocks(req)
                self._mark_draft_filled(req, result.num_draft_computed.get(req.request_id))
                continue
            new_ids = result.sampled_token_ids.get(req.request_id, [])
            k = len(seq.draft_token_ids)
            computed, num_acc = verified(seq.num_tokens, k, len(new_ids))
            # Roll back the rejected drafts: their K/V slots hold garbage and are simply
            # overwritten later; only accepted tokens count as computed (and get cached).
            req.num_computed_tokens += computed
            if k:
                self.spec_stats.observe(k, num_acc)
                if spec is not None:
                    spec.observe_round(num_acc, k, req.spec_cap, req.params.greedy)
            accepted: list[int] = []
            finished = False
            if new_ids and not req.first_token_ns:
                req.first_token_ns = time.perf_counter_ns()
            for tok in new_ids:
                accepted.append(tok)
                if req.append_output(tok):
                    finished = True
                    break
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
            self._register_full_blocks(req)
            if req.fork_children:
                self._mark_draft_filled(req, result.num_draft_computed.get(req.request_id))
                self._fork(req)
            lps = result.logprobs.get(req.request_id)
            co = EngineCoreOutput(req.request_id, accepted, lps[: len(accepted)] if lps else None, finished,
                                  req.finish_reason, req.stop_reason, k, num_acc)
            co.prompt_logprobs = result.prompt_logprobs.get(req.request_id)
            co.stop_token = finished and req.stopped_by_token
            if not req.reported_cached:
                co.num_cached_tokens = req.num_cached_tokens
                co.prefix_break_token = req.prefix_break_token
                req.reported_cached = True
            if req.events:
                co.events, req.events = req.events, []
            outputs.append(co)
            if finished:
                self.running.remove(req)
                if req.kv_pin_s > 0:
                    self._pin(req)
                self._release(req)
                continue
            self._mark_draft_filled(req, result.num_draft_computed.get(req.request_id))
            drafts = result.draft_token_ids.get(req.request_id)
            if drafts:
                req.spec_token_ids = drafts[: max(req.room_for_drafts, 0)]
            req.spec_cap = result.draft_caps.get(req.request_id, 0)
        if result.suffix_cache is not None:
            self.suffix_cache = result.suffix_cache
        if spec is not None and result.draft_step_s is not None and result.num_drafting:
            spec.draft_cost.observe(result.num_drafting, result.draft_step_s)
        return outputs

    def _fork(self, first: Request) -> None:
        """Fork the samples waiting on ``first``, whose prompt is now computed."""
        now_ns = time.perf_counter_ns()
        bs = self.block_size
        queued: list[Request] = []
        for child in first.fork_children:
            child.fork_parent = None
            p = child.num_prompt_tokens
            last = (p - 1) // bs  # the block holding the last prompt token: the first one written
            if len(self.running) >= self.config.max_num_seqs or self.pool.num_free_blocks < 1:
                queued.append(child)
                continue
            shared = first.block_ids[:last]
            self.pool.touch(shared)
            own = self.pool.allocate(1, shared[-1] if shared else None)[0]
            if (p - 1) % bs:  # tokens before the last one live in that block: copy them
                src = first.block_ids[last]
                self.pool.touch([src])
                self._pending_copies.append((src, own))
                self.num_fork_copied_blocks += 1
            child.block_ids = [*shared, own]
            child.num_computed_tokens = p - 1
            child.block_hashes = list(first.block_hashes[:last])
            child.num_registered_blocks = last if self.pool.enable_prefix_caching else 0
            filled = self.pool.num_draft_filled(shared)
            child.num_draft_marked = filled
            child.num_draft_cached_tokens = min(p - 1, filled * bs)
            child.num_cached_tokens = p - 1  # not computed for this sample
            child.num_sent_blocks = None
            child.status = RequestStatus.RUNNING
            child.events.append(("scheduled", now_ns))
            self.running.append(child)
            self.num_forks += 1
            self.num_fork_shared_blocks += len(shared)
        first.fork_children = []
        self.waiting.extendleft(reversed(queued))

    def _mark_draft_filled(self, req: Request, num_draft_computed: int | None) -> None:
        """Flag the request's full blocks that now hold the draft's K/V (for prefix hits), and
        keep the count of tokens it has seen (the outlook's catch-up)."""
        if num_draft_computed is None:
            return
        req.num_draft_seen_tokens = num_draft_computed
        n = min(num_draft_computed // self.block_size, len(req.block_ids))
        if n > req.num_draft_marked:
            self.pool.mark_draft_filled(req.block_ids[req.num_draft_marked : n])
            req.num_draft_marked = n

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
                                  tuple(req.all_token_ids[b * bs : (b + 1) * bs]),
                                  req.block_hashes[b - 1] if b else None)
        req.num_registered_blocks = full

    def check_consistency(self) -> None:
        """Raise if block ownership and the pool disagree (used by tests): every block's ref
        count equals the number of live requests holding it."""
        holders: dict[int, int] = {}
        for r in self.requests.values():
            for b in r.block_ids:
                holders[b] = holders.get(b, 0) + 1
        for src, _ in self._pending_copies:
            holders[src] = holders.get(src, 0) + 1
        for block in self.pool.blocks:
            if block.ref_count != holders.get(block.block_id, 0):
                raise AssertionError(f"block {block.block_id}: ref count {block.ref_count}, "
                                     f"held by {holders.get(block.block_id, 0)} requests")
        self.pool.check_consistency()
