"""The engine: owns the model, KV cache, scheduler and runner, and runs one step at a time.

``add_request`` validates and queues; ``step`` schedules, runs one forward pass, samples,
updates request state and returns the outputs of the requests that progressed;
``abort_request`` ends a request and frees its blocks. The server's async engine and the
offline ``LLM`` both drive this loop.
"""

from __future__ import annotations

import itertools
import pathlib
import time
from collections import deque
from dataclasses import dataclass

import torch

from tailserve.assets import resolve_model_path
from tailserve.config import EngineConfig
from tailserve.engine.detokenizer import IncrementalDetokenizer
from tailserve.engine.model_runner import ModelRunner
from tailserve.engine.request import Request, RequestStatus
from tailserve.engine.scheduler import RequestUpdate, Scheduler
from tailserve.errors import ConfigError, InvalidRequestError
from tailserve.memory.block_pool import BlockPool
from tailserve.memory.kv_cache import allocate_kv_caches, kv_bytes_per_block
from tailserve.metrics.prometheus import PrometheusMetrics
from tailserve.metrics.timeline import RequestMetrics, RequestTimeline, StepStats
from tailserve.model.config import load_arch_config, parse_dtype
from tailserve.model.loader import load_model
from tailserve.model.tokenizer import Tokenizer
from tailserve.outputs import CompletionOutput, RequestOutput
from tailserve.sampling_params import SamplingParams
from tailserve.spec.adaptive import AdaptiveSpeculation
from tailserve.spec.numpy_draft import NUMPY_DRAFT_MAX_PARAMETERS, NumpyDraftStep
from tailserve.spec.proposer import DraftModelProposer, HybridProposer, NgramProposer, ProposalInput
from tailserve.spec.stats import SpecDecodeStats

Prompt = str | list[int]


@dataclass(frozen=True)
class PreparedRequest:
    """A validated, tokenized request, ready for ``add_prepared``."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class _RequestState:
    prompt: str | None
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, float]] | None


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device cuda requested but torch.cuda.is_available() is False")
        model_dir = pathlib.Path(resolve_model_path(config.model))
        self.model_dir = model_dir
        dtype = None if config.dtype == "auto" else parse_dtype(config.dtype)
        arch = load_arch_config(model_dir)
        max_len = config.max_model_len or arch.max_position_embeddings
        if max_len > arch.max_position_embeddings:
            raise ConfigError(f"max_model_len {max_len} exceeds the model's max_position_embeddings "
                              f"{arch.max_position_embeddings}")
        self.max_model_len = max_len
        self.model, self.arch = load_model(model_dir, dtype, self.device, max_positions=max_len,
                                           pack_cpu_weights=config.cpu_onednn)
        self.dtype = self.model.embed_tokens.dtype
        self.tokenizer = Tokenizer.maybe_load(model_dir)

        per_block = kv_bytes_per_block(self.arch, config.block_size, self.dtype)
        self.spec_method = config.speculative_method
        draft_model = draft_arch = None
        draft_numpy = False
        if self.spec_method in ("draft_model", "hybrid"):
            draft_dir = pathlib.Path(resolve_model_path(config.speculative_model, draft=True))
            draft_arch = load_arch_config(draft_dir)
            draft_numpy = config.speculative_draft_numpy
            if draft_numpy is None:
                # Only small drafts: NumPy reads float32 weights (twice PyTorch's bf16 bytes), which
                # outweighs the per-operation overhead it saves beyond a few million parameters.
                draft_numpy = (self.device.type == "cpu" and config.speculative_draft_dtype in ("auto", "float32")
                               and draft_arch.sliding_window is None
                               and draft_arch.num_parameters <= NUMPY_DRAFT_MAX_PARAMETERS)
            elif draft_numpy and draft_arch.sliding_window is not None:
                raise ConfigError("speculative_draft_numpy: the NumPy draft step has no sliding window, "
                                  "and this draft model uses one")
            if config.speculative_draft_dtype != "auto":
                draft_dtype = parse_dtype(config.speculative_draft_dtype)
            else:
                draft_dtype = torch.float32 if draft_numpy else self.dtype
            # Packed for oneDNN only once the NumPy step (if any) has copied the plain weights.
            draft_model, draft_arch = load_model(draft_dir, draft_dtype, self.device, max_positions=max_len)
            if draft_arch.vocab_size != self.arch.vocab_size:
                raise ConfigError(f"draft model vocabulary ({draft_arch.vocab_size}) differs from the target's "
                                  f"({self.arch.vocab_size}); speculative decoding needs the same tokenizer")
            if draft_arch.max_position_embeddings < max_len:
                raise ConfigError(f"draft model context ({draft_arch.max_position_embeddings}) is shorter than "
                                  f"max_model_len {max_len}")
            # One block id addresses both caches, so the byte budget pays for both.
            per_block += kv_bytes_per_block(draft_arch, config.block_size, draft_dtype)
        num_blocks = config.kv_cache_memory_bytes // per_block
        if num_blocks < 1:
            raise ConfigError(f"kv_cache_memory_bytes {config.kv_cache_memory_bytes} holds no block "
                              f"(one block of {config.block_size} tokens takes {per_block} bytes)")
        self.kv_caches = allocate_kv_caches(self.arch, num_blocks, config.block_size, self.dtype, self.device)
        self.block_pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config, self.block_pool)
        self.runner = ModelRunner(self.model, self.arch, self.kv_caches, config.block_size, self.device, config.seed)
        self.proposer: DraftModelProposer | HybridProposer | NgramProposer | None = None
        if draft_model is not None and draft_arch is not None:
            draft_caches = allocate_kv_caches(draft_arch, num_blocks, config.block_size,
                                              draft_model.embed_tokens.dtype, self.device)
            numpy_step = NumpyDraftStep(draft_model, draft_arch, draft_caches) if draft_numpy else None
            if config.cpu_onednn and self.device.type == "cpu":
                draft_model.pack_for_cpu()
            self.proposer = DraftModelProposer(draft_model, draft_arch, draft_caches, config.block_size, self.device,
                                               self.runner.sampler.generator,
                                               stop_margin=config.draft_stop_margin, numpy_step=numpy_step)
            if self.spec_method == "hybrid":
                self.proposer = HybridProposer(self.proposer, NgramProposer(config.ngram_min, config.ngram_max),
                                               self.arch.vocab_size)
        elif self.spec_method == "ngram":
            self.proposer = NgramProposer(config.ngram_min, config.ngram_max)
        self.spec_controller = AdaptiveSpeculation(k_max=config.num_speculative_tokens or config.speculative_max_tokens,
                                                   fixed_k=config.num_speculative_tokens)
        self.spec_stats = SpecDecodeStats()
        self._draft_probs: dict[str, torch.Tensor] = {}

        eos = set(self.arch.eos_token_ids)
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self._states: dict[str, _RequestState] = {}
        self._ids = itertools.count()

        self.model_name = config.served_model_name or model_dir.name
        self.metrics_enabled = config.enable_metrics
        self.prometheus = PrometheusMetrics(self.model_name) if config.enable_metrics else None
        self.step_log: deque[StepStats] = deque(maxlen=4096)
        self.num_steps = 0

    # -- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", "prompt")
            if self.tokenizer is None:
                raise InvalidRequestError(f"{self.model_dir} has no tokenizer.json; pass token ids instead of text",
                                          "prompt")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, list | tuple):
            raise InvalidRequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                                      "prompt")
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        vocab = self.arch.vocab_size
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab}), got {t!r}", "prompt")
        return None, list(prompt)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_ns: int | None = None) -> str:
        """Validate and queue a request. ``arrival_ns`` (perf_counter_ns) lets a server stamp
        the moment the request arrived rather than when it reached the engine."""
        prepared = self.prepare_request(prompt, params)
        return self.add_prepared(prepared, request_id, arrival_ns)

    def prepare_request(self, prompt: Prompt, params: SamplingParams | None = None) -> PreparedRequest:
        """Tokenize and validate without touching engine state (safe from another thread)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling params must be a SamplingParams", "sampling_params")
        text, ids = self.tokenize(prompt)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens but the model's context (max_model_len) is {self.max_model_len}; "
                "at least one token must be left to generate", "prompt")
        total = min(len(ids) + params.max_tokens, self.max_model_len)
        need_blocks = -(-total // self.config.block_size)
        if need_blocks > self.block_pool.num_blocks:
            raise InvalidRequestError(
                f"prompt + max_tokens needs {need_blocks} KV blocks but the cache holds "
                f"{self.block_pool.num_blocks}; raise --kv-cache-memory or lower max_tokens", "max_tokens")
        for t in params.stop_token_ids:
            if t >= self.arch.vocab_size:
                raise InvalidRequestError(f"stop token id {t} is outside the vocabulary ({self.arch.vocab_size})",
                                          "stop_token_ids")
        if self.tokenizer is None and params.stop:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none", "stop")
        return PreparedRequest(text, ids, params)

    def add_prepared(self, prepared: PreparedRequest, request_id: str | None = None,
                     arrival_ns: int | None = None) -> str:
        arrival_ns = time.perf_counter_ns() if arrival_ns is None else arrival_ns
        text, ids, params = prepared.prompt, prepared.prompt_token_ids, prepared.params
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.scheduler.requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use", "request_id")
        req = Request(rid, ids, params, self.eos_token_ids, self.max_model_len)
        if self.metrics_enabled:
            req.timeline = RequestTimeline(arrival_ns)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens, params.stop,
                                           params.include_stop_str_in_output)
        self._states[rid] = _RequestState(text, detok, [] if params.logprobs is not None else None)
        self.scheduler.add_request(req)
        return rid

    def abort_request(self, request_id: str) -> RequestMetrics | None:
        """End a request now and free its blocks; returns its metrics (if recorded)."""
        req = self.scheduler.requests.get(request_id)
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self._states.pop(request_id, None)
        return self._record_finished(req) if req is not None else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter_ns()
        preempted_before = self.scheduler.num_preemptions
        sched = self.scheduler.schedule(t0)
        if sched.is_empty:
            self.runner.forget(sched.finished_ids)
            return []
        params = {s.request_id: self.scheduler.requests[s.request_id].params for s in sched.scheduled}
        draft_probs = self._draft_probs if isinstance(self.proposer, DraftModelProposer | HybridProposer) else None
        result = self.runner.execute(sched, params, draft_probs)
        t1 = time.perf_counter_ns()
        updates = self.scheduler.update(sched, result, t1)
        if self.proposer is not None:
            self._after_verification(sched, updates)
        outputs = [self._process(u) for u in updates]
        if self.proposer is not None:
            # Costs for the controller: the target's forward with its sampling (fitted against
            # the verified tokens), the rest of the step (scheduling, output bookkeeping,
            # detokenizing: paid per step and per emitted token, with or without drafts), and
            # the proposal (observed in _propose). Only decode/verify steps: a prefill chunk's
            # tokens cost more each (their attention spans the chunk), and fitted together
            # with decodes they would make every verified token look several times dearer.
            if not any(s.is_prefill for s in sched.scheduled):
                self.spec_controller.observe_step(sched.num_scheduled_tokens, (t1 - t0) * 1e-9,
                                                  (time.perf_counter_ns() - t1) * 1e-9)
            self._propose()
        self.num_steps += 1
        if self.metrics_enabled:
            new_tokens = sum(len(u.new_token_ids) for u in updates)
            self._record_step(sched, t1 - t0, self.scheduler.num_preemptions - preempted_before, new_tokens)
        return outputs

    # -- speculative decoding ------------------------------------------------------------
    def _after_verification(self, sched, updates: list[RequestUpdate]) -> None:
        for s in sched.scheduled:
            self._draft_probs.pop(s.request_id, None)  # consumed (or dropped) this step
        for rid in sched.finished_ids:
            self._draft_probs.pop(rid, None)
        for u in updates:
            k, m = u.num_draft_tokens, u.num_accepted
            if not k:
                continue
            self.spec_stats.observe(k, m)
            self.spec_controller.observe_round(m, k, u.request.spec_cap)
            if self.prometheus is not None:
                self.prometheus.observe_spec(k, m)
            # The draft chain wrote K/V for drafts 1..k-1; the accepted ones are now valid.
            u.request.num_draft_seen += min(m, k - 1)

    def _propose(self) -> None:
        running = [r for r in self.scheduler.running if not r.is_finished]
        decoding = [r for r in running if r.num_computed_tokens >= r.num_prompt_tokens]
        k = self.spec_controller.choose_k(len(decoding))
        if k == 0:
            return  # speculation off this step; a draft model catches up when it is back on
        uses_draft_model = isinstance(self.proposer, DraftModelProposer | HybridProposer)
        inputs = []
        for req in running:
            if req.spec_token_ids:
                continue  # drafts from an earlier step still wait for verification
            in_decode = req.num_computed_tokens >= req.num_prompt_tokens
            kk = 0
            if in_decode:
                kk = min(k, req.params.max_tokens - req.num_output_tokens - 1,
                         self.max_model_len - req.num_tokens - 1)
                if kk > 0 and not self.scheduler.reserve(req, req.num_tokens + kk):
                    kk = 0
                req.spec_cap = max(kk, 0)
            if not uses_draft_model and kk <= 0:
                continue  # n-gram lookup has nothing to catch up on
            valid = req.num_tokens if in_decode else req.num_computed_tokens
            # The draft can only write K/V into slots the request already owns.
            valid = min(valid, len(req.block_ids) * self.config.block_size)
            inputs.append(ProposalInput(req.request_id, req.all_token_ids, req.num_draft_seen, valid,
                                        req.block_ids, max(kk, 0), req.params,
                                        self.runner.generator_for(req.request_id, req.params)))
        if not inputs:
            return
        t0 = time.perf_counter()
        proposal = self.proposer.propose(inputs)  # type: ignore[union-attr]
        for inp in inputs:
            req = self.scheduler.requests[inp.request_id]
            req.spec_token_ids = proposal.draft_ids.get(inp.request_id, [])
            req.num_draft_seen = proposal.num_seen.get(inp.request_id, req.num_draft_seen)
            if uses_draft_model:
                self._mark_draft_filled(req)
            if proposal.draft_probs is not None and inp.request_id in proposal.draft_probs:
                self._draft_probs[inp.request_id] = proposal.draft_probs[inp.request_id]
        drafted = sum(1 for i in inputs if i.k > 0)
        if drafted and proposal.num_forwards:
            # Per step of a steady-state round (early stops make rounds shorter than k): the
            # whole proposal, overheads included. A catch-up over a prompt, or over what was
            # generated while speculation was off, is not observed: charged to its few steps
            # it made a draft forward look ten times dearer, and the controller then kept
            # speculation off.
            self.spec_controller.draft_cost.observe(drafted, (time.perf_counter() - t0) / proposal.num_forwards)

    def _mark_draft_filled(self, req) -> None:
        """Flag the request's full blocks that now hold the draft's K/V (for prefix hits)."""
        blocks = self.block_pool.blocks
        n = min(req.num_draft_seen // self.config.block_size, len(req.block_ids))
        for i in range(req.num_draft_marked, n):
            blocks[req.block_ids[i]].draft_filled = True
        req.num_draft_marked = max(req.num_draft_marked, n)

    def _record_step(self, sched, duration_ns: int, preemptions: int, new_tokens: int) -> None:
        running = self.scheduler.running
        live = sum(r.num_computed_tokens for r in running)
        slots = sum(len(r.block_ids) for r in running) * self.config.block_size
        prefill = sum(len(s.token_ids) for s in sched.scheduled if s.is_prefill)
        stats = StepStats(
            step=self.num_steps, duration_s=duration_ns * 1e-9, num_requests=len(sched.scheduled),
            num_prefill_tokens=prefill, num_decode_tokens=sched.num_scheduled_tokens - prefill,
            num_running=len(running), num_waiting=self.scheduler.num_waiting,
            kv_blocks_used=self.block_pool.num_used_blocks, kv_blocks_total=self.block_pool.num_blocks,
            kv_token_utilization=live / slots if slots else 0.0, num_preemptions=preemptions,
        )
        self.step_log.append(stats)
        if self.prometheus is not None:
            ps = self.block_pool.stats
            self.prometheus.observe_step(stats, ps.queries_tokens, ps.hits_tokens)
            self.prometheus.observe_tokens(new_tokens)

    def _record_finished(self, req: Request) -> RequestMetrics | None:
        if req.timeline is None:
            return None
        rm = RequestMetrics.from_timeline(req.request_id, req.timeline, req.num_prompt_tokens,
                                          req.num_cached_tokens, req.finish_reason,
                                          (req.spec_num_drafts, req.spec_num_draft_tokens,
                                           req.spec_num_accepted_tokens))
        if self.prometheus is not None:
            self.prometheus.observe_finished(rm)
        return rm

    def _process(self, u: RequestUpdate) -> RequestOutput:
        req = u.request
        state = self._states[req.request_id]
        delta_text = ""
        finished = u.finished
        if state.detokenizer is not None:
            delta_text, hit = state.detokenizer.append(u.new_token_ids)
            if hit is not None:
                if not finished:
                    self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                    finished = True
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = hit
        if state.logprobs is not None and u.new_logprobs:
            state.logprobs.extend(u.new_logprobs)
        completion = CompletionOutput(
            index=0,
            text=state.detokenizer.text if state.detokenizer is not None else "",
            token_ids=req.output_token_ids,
            finish_reason=req.finish_reason if finished else None,
            stop_reason=req.stop_reason if finished else None,
            logprobs=state.logprobs,
        )
        metrics = None
        if finished:
            self._states.pop(req.request_id, None)
            metrics = self._record_finished(req)
        return RequestOutput(
            request_id=req.request_id,
            prompt=state.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_preemptions=req.num_preemptions,
            delta_text=delta_text,
            delta_token_ids=u.new_token_ids,
            metrics=metrics,
        )
