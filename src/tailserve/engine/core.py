"""The engine core: schedule -> execute -> update, and nothing else.

It owns the scheduler (with the block pool and, with speculative decoding, the adaptive
controller) and the worker. ``step`` returns per-request ``EngineCoreOutput``s: new token
ids and why a request finished; text, stop strings and metrics are the output processor's.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace

import torch

from tailserve.config import EngineConfig, long_prefill_threshold, parse_slo
from tailserve.engine.processor import PreparedRequest
from tailserve.engine.request import Request, RequestStatus
from tailserve.engine.scheduler import Scheduler
from tailserve.engine.scheduler_output import (
    EngineCoreOutput,
    GrammarBitmask,
    ModelExecutor,
    ModelRunnerOutput,
    SchedulerOutput,
    StepAppliedError,
    StepCost,
)
from tailserve.errors import InvalidRequestError, TailserveError
from tailserve.memory.block_hash import block_hash_fn
from tailserve.memory.block_pool import BlockPool
from tailserve.memory.kv_events import KVEventLog
from tailserve.metrics.timeline import StepStats
from tailserve.sampling_params import SamplingParams
from tailserve.speculative.adaptive import AdaptiveSpeculation
from tailserve.structured.grammar import BitmaskBuilder

log = logging.getLogger("tailserve.engine")


class EngineStepError(TailserveError):
    """A step failed for a reason that is not the requests' fault (a bug, a device error).
    The requests it had scheduled are finished (aborted); the engine keeps serving."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


@dataclass
class _StepTiming:
    started_ns: int
    num_tokens: int
    target_forward_s: float
    propose_s: float
    decode_only: bool
    num_emitted: int = 0
    spec_round: tuple[int, int, bool, bool] | None = None
    num_rounds: int = 0
    num_accepted: int = 0


class EngineCore:
    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int] | None = None,
                 worker: ModelExecutor | None = None, speculation: AdaptiveSpeculation | None = None) -> None:
        """``worker``: any ``ModelExecutor`` (default: a ``Worker``, or the tensor-parallel
        executor); ``speculation``: the draft-length policy (default: the adaptive controller
        when the worker has a proposer)."""
        self.config = config
        if worker is None:
            if config.tensor_parallel_size > 1:
                from tailserve.engine.tensor_parallel import TensorParallelExecutor

                worker = TensorParallelExecutor(config)
            else:
                from tailserve.engine.worker import Worker

                worker = Worker(config)
        self.worker = worker
        info = self.info = worker.info
        self.max_model_len = info.max_model_len
        eos = set(info.arch.eos_token_ids) or set(eos_token_ids or ())
        self.eos_token_ids = frozenset(eos)
        kv_events = config.kv_events_config
        self.block_pool = BlockPool(info.num_blocks, config.block_size, config.enable_prefix_caching,
                                    hash_fn=block_hash_fn(config.prefix_caching_hash_algo),  # type: ignore[arg-type]
                                    events=KVEventLog() if kv_events is not None and kv_events.enabled else None)
        if speculation is None and info.has_proposer:
            speculation = AdaptiveSpeculation(k_max=config.num_speculative_tokens or config.speculative_max_tokens,
                                              fixed_k=config.num_speculative_tokens,
                                              max_rows=info.plan.max_verify_rows,
                                              hold_beside_prompts=info.lookup_proposer,
                                              max_backoff=AdaptiveSpeculation.LOOKUP_MAX_BACKOFF
                                              if info.lookup_proposer else AdaptiveSpeculation.max_backoff,
                                              cost_profile=info.verify_costs,
                                              objective=config.speculative_objective,
                                              slo=parse_slo(config.slo) if config.slo is not None else None)
        sched_config = replace(config.scheduler_config,
                               max_num_partial_prefills=info.plan.max_num_partial_prefills,
                               max_long_partial_prefills=info.plan.max_long_partial_prefills,
                               long_prefill_token_threshold=long_prefill_threshold(info.max_model_len))
        self.scheduler = Scheduler(sched_config, self.block_pool, speculation)
        self.step_log: deque[StepStats] = deque(maxlen=4096)
        self.num_steps = 0
        self.num_oom_preemptions = 0  # requests preempted because a step ran out of device memory
        # Constrained decoding: the step's grammar masks, computed on their own thread while
        # the forward runs (llguidance drops the GIL); built on the first constrained request.
        self.grammar_overlap_min_rows = info.plan.grammar_overlap_min_rows  # the plan's; benchmarks vary it
        self._bitmask_builder: BitmaskBuilder | None = None
        self._mask_pool: ThreadPoolExecutor | None = None
        self._pending_timing: _StepTiming | None = None
        self._last_cost: StepCost | None = None  # the last finished decode step's, for the next update

    # -- requests --------------------------------------------------------------------------
    def _request(self, request_id: str, prepared: PreparedRequest, params: SamplingParams) -> Request:
        req = Request(request_id, prepared.prompt_token_ids, params, self.eos_token_ids, self.max_model_len)
        if prepared.grammar is not None:
            req.grammar = prepared.grammar.start()  # each sample its own matcher
        req.kv_pin_s = prepared.kv_pin_s
        return req

    def add_request(self, request_id: str, prepared: PreparedRequest, arrival_ns: int = 0) -> None:
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        req = self._request(request_id, prepared, prepared.params)
        req.arrival_ns = arrival_ns
        self.scheduler.add_request(req)

    def add_samples(self, prepared: PreparedRequest, samples: list[tuple[str, SamplingParams]],
                    arrival_ns: int = 0) -> None:
        """Several samples of one prompt (``n`` > 1, ``best_of``): the prompt is computed
        once and its blocks shared (``Scheduler.add_fork_group``)."""
        reqs = [self._request(rid, prepared, params) for rid, params in samples]
        for req in reqs:
            req.arrival_ns = arrival_ns
        try:
            self.scheduler.add_fork_group(reqs[0], reqs[1:])
        except ValueError as e:
            raise InvalidRequestError(str(e), "request_id") from None

    def unpin(self, request_ids: list[str]) -> None:
        """End finished requests' KV pins (``PreparedRequest.kv_pin_s``): their answers were final."""
        for rid in request_ids:
            self.scheduler.unpin(rid)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> dict[str, list[tuple[str, int]]]:
        """Finish requests from outside a step; returns each one's unreported timeline events."""
        return {rid: self.scheduler.finish_request(rid, status) for rid in request_ids}

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        t0 = time.perf_counter_ns()
        preempted_before = self.scheduler.num_preemptions
        sched = self.scheduler.schedule(t0)
        if sched.is_empty:
            self.worker.free(sched.finished_ids)
            return []
        sched.grammar = self._grammar_masks(sched)
        try:
            result = self.worker.execute(sched)
        except TailserveError:
            self._settle_masks(sched)
            raise
        except Exception as e:
            self._settle_masks(sched)
            if _is_out_of_memory(e) and len(sched.scheduled) > 1 and not isinstance(e, StepAppliedError):
                # Out of device memory with several requests in the step, before the worker
                # applied any result: give memory back and preempt the newest half; the rest
                # run the same step again next time. (An OOM after that point, in the draft
                # proposal, fails the step's requests as any other error does.)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                victims = self.scheduler.preempt_after_failed_step(sched, time.perf_counter_ns())
                self.num_oom_preemptions += len(victims)
                log.warning("out of memory in a step of %d requests: preempted %s (recomputed later)",
                            len(sched.scheduled), ", ".join(victims))
                return []
            ids = [s.request_id for s in sched.scheduled]
            for rid in ids:
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            raise EngineStepError(f"{type(e).__name__}: {e}", ids) from e
        self._settle_masks(sched)  # done already where the worker sampled; a fake executor may not
        cost, self._last_cost = self._last_cost, None
        outputs = self.scheduler.update(sched, result, cost)
        self.num_steps += 1
        emitted = sum(len(o.new_token_ids) for o in outputs)  # the step log's, and the speculation policy's
        if sched.spec_round is not None:  # what only the speculation policy reads (None: a quiet step)
            # One pass each (paid every step, speculating or not: ~1 ms steps at batch 1 here).
            num_tokens, decode_only = 0, True
            for s in sched.scheduled:
                num_tokens += s.num_tokens
                decode_only = decode_only and not s.is_prefill
            rounds = accepted = 0
            for o in outputs:
                if o.num_draft_tokens:
                    rounds += 1
                    accepted += o.num_accepted_tokens
            self._pending_timing = _StepTiming(t0, num_tokens, result.target_forward_s, result.propose_s, decode_only,
                                               emitted, sched.spec_round, rounds, accepted)
        self._record_step(sched, time.perf_counter_ns() - t0, self.scheduler.num_preemptions - preempted_before,
                          result, emitted)
        return outputs

    def _grammar_masks(self, sched: SchedulerOutput) -> GrammarBitmask | None:
        """Start computing the masks of the constrained requests that sample this step: one
        row for the sampled position and one after each draft (grammar.BitmaskBuilder)."""
        entries = []
        first_rows: dict[str, int] = {}
        row = 0
        requests = self.scheduler.requests
        for s in sched.scheduled:
            if not s.sample:
                continue
            req = requests.get(s.request_id)
            if req is None or req.grammar is None:
                continue
            first_rows[s.request_id] = row
            entries.append((req.grammar, s.draft_token_ids))
            row += len(s.draft_token_ids) + 1
        if not entries:
            return None
        if self._bitmask_builder is None:
            # Beside the forward (a GPU's host is idle): llguidance's threads; else in place.
            self._bitmask_builder = BitmaskBuilder(self.info.arch.vocab_size,
                                                   parallel=self.info.plan.grammar_masks_parallel)
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="tailserve-grammar")
        assert self._mask_pool is not None
        if row < self.grammar_overlap_min_rows:
            return GrammarBitmask(first_rows, self._bitmask_builder.build(entries))
        return GrammarBitmask(first_rows, self._mask_pool.submit(self._bitmask_builder.build, entries))

    @staticmethod
    def _settle_masks(sched: SchedulerOutput) -> None:
        """Let the step's mask computation finish before anything touches the matchers again
        (it walks them through the drafts and back): after a failed step, and after one whose
        executor did not sample (the worker otherwise waited for it already)."""
        if sched.grammar is not None and isinstance(sched.grammar.pending, Future):
            wait([sched.grammar.pending])

    def end_step(self, end_ns: int | None = None) -> None:
        """The caller has processed the step's outputs: the step's full cost is known. It
        reaches the speculation policy with the next ``Scheduler.update`` (the policy's one
        input route), as a ``StepCost``: the target's forward with its sampling, the proposal,
        and the whole step (scheduling, bookkeeping, output processing and detokenizing: paid
        per step with or without drafts). The cost model is fitted on decode/verify steps
        only: a prefill chunk's tokens cost more each (their attention spans the chunk), and
        fitted together with decodes they would make every verified token look several times
        dearer. The measured throughput counts every step, those that admit a request apart
        from the decode steps: a served load admits requests all the time, and a step that
        admits one costs 2-4x a decode step, more with drafts (the draft's prefill of the
        prompt, the verify rows beside the chunk); leaving them out made speculation look
        faster than it was at saturation (built-in pair, AVX-512, Poisson arrivals:
        docs/benchmarks.md)."""
        timing, self._pending_timing = self._pending_timing, None
        if timing is None or self.scheduler.speculation is None:
            return
        end_ns = time.perf_counter_ns() if end_ns is None else end_ns
        self._last_cost = StepCost(timing.num_tokens, timing.num_emitted, (end_ns - timing.started_ns) * 1e-9,
                                   timing.target_forward_s, timing.propose_s, timing.spec_round, timing.decode_only,
                                   timing.num_rounds, timing.num_accepted)

    def _record_step(self, sched, duration_ns: int, preemptions: int, result: ModelRunnerOutput,
                     num_output_tokens: int) -> None:
        running = self.scheduler.running
        live = sum(r.num_computed_tokens for r in running)
        slots = sum(len(r.block_ids) for r in running) * self.config.block_size
        prefill = sum(s.num_tokens for s in sched.scheduled if s.is_prefill)
        self.step_log.append(StepStats(
            step=self.num_steps, duration_s=duration_ns * 1e-9, num_requests=len(sched.scheduled),
            num_prefill_tokens=prefill, num_decode_tokens=sched.num_scheduled_tokens - prefill,
            num_running=len(running), num_waiting=self.scheduler.num_waiting,
            kv_blocks_used=self.block_pool.num_used_blocks, kv_blocks_total=self.block_pool.num_blocks,
            kv_token_utilization=live / slots if slots else 0.0, num_preemptions=preemptions,
            target_forward_s=result.target_forward_s, propose_s=result.propose_s,
            num_output_tokens=num_output_tokens,
        ))


def _is_out_of_memory(e: BaseException) -> bool:
    """PyTorch's out-of-memory error (CUDA, or another device that raises the same type)."""
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom is not None and isinstance(e, oom)) or ("out of memory" in str(e).lower() and isinstance(
        e, RuntimeError))
