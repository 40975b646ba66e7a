"""Turns a ``SchedulerOutput`` into one forward pass, sampled tokens and the next drafts.

The runner keeps a persistent per-request state (token ids, block table,
what the draft model holds, the draft probabilities of the drafts in flight), built from a
request's ``NewRequestData`` once and then updated from each step's deltas and from its own
sampled tokens; the scheduler's ``Request`` objects are never shared with it.

All scheduled work of a step (prefill chunks, decodes, verifications) is one flat batch of
tokens. The runner builds the inputs and attention metadata, runs the model, computes
logits only at the positions that sample, samples (or verifies drafts with the rejection
sampler), then asks the proposer for the next round's drafts where the scheduler reserved
room for them. Draft probabilities stay here. It never decides policy.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tailserve.attention.backend import AttentionBackend, DecodeGraph
from tailserve.attention.reference import TorchReferenceBackend
from tailserve.engine.scheduler_output import (
    GrammarBitmask,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    StepAppliedError,
    draft_room,
    verified,
)
from tailserve.model.config import ModelArchConfig
from tailserve.model.linear import CpuCompactWeightsLinearMethod
from tailserve.model.llama import LlamaFamilyModel
from tailserve.sample.bitmask import apply_token_bitmask
from tailserve.sample.logits_processors import apply_logits_processors
from tailserve.sample.rejection import RejectionSampler, greedy_rows, synthetic_rows
from tailserve.sample.sampler import Sampler, SamplingTensors, SamplingTensorsCache, fast_argmax, seeded_key
from tailserve.sampling_params import SamplingParams
from tailserve.speculative.adaptive import VerifyCostProfile
from tailserve.speculative.proposer import ProposalInput, Proposer


@dataclass
class CachedRequestState:
    """The worker's view of one live request."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_draft_seen: int = 0  # tokens whose K/V the draft model holds
    draft_token_ids: list[int] = field(default_factory=list)  # proposed last step, verified next
    draft_probs: torch.Tensor | None = None  # (k, V) q of those drafts; None = greedy or one-hot
    prompt_logprobs: list[dict[int, float] | None] | None = None  # gathered over prefill chunks

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class ModelRunner:
    def __init__(self, model: LlamaFamilyModel, arch: ModelArchConfig, kv_caches: list[torch.Tensor],
                 block_size: int, device: torch.device, seed: int = 0, max_model_len: int | None = None,
                 proposer: Proposer | None = None, attn_backend: AttentionBackend | None = None,
                 sampler: Sampler | None = None, synthetic_acceptance: float | None = None,
                 verification: str = "token",
                 native_prefill: Callable[[bool], contextlib.AbstractContextManager] | None = None,
                 fused_rows: int = 0) -> None:
        self.model = model
        # Where the plan lets prompt-only steps multiply in the weights' native dtype
        # (CpuCompactWeightsLinearMethod.native_scope): called with that step's answer.
        self.native_prefill = native_prefill
        # The fused decode layer's rows (0: no fused layers): a step of more rows whose sequences
        # each bring at most that many runs as forwards of groups within it (_forward_in_groups).
        self.fused_rows = fused_rows
        self.arch = arch
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.host = device.type == "cpu"  # fast_argmax's NumPy path
        self.max_model_len = max_model_len or arch.max_position_embeddings
        self.attn_backend = attn_backend or TorchReferenceBackend(block_size, 256, 2048, self.max_model_len,
                                                                  arch.sliding_window, device)
        # The sampler (and its generator, which a draft model's proposer shares) is built first
        # by the worker when there is a proposer; a runner of its own otherwise.
        self.sampler = sampler or Sampler(arch.vocab_size, device, seed)
        self._sampling_tensors = SamplingTensorsCache(arch.vocab_size, device, self.sampler.kernels)
        self.rejection_sampler = RejectionSampler(self.sampler.generator, self.sampler.noise, verification,
                                                  self.sampler.kernels)
        # Benchmarks only (LOSSY): drafts accepted with this probability whatever the target says.
        self.synthetic_acceptance = synthetic_acceptance
        self.proposer = proposer
        # What the proposer needs, declared by it once: a draft model's K/V kept in step with
        # the accepted tokens, and its q for the rejection sampler.
        self.uses_draft_kv = proposer is not None and proposer.uses_draft_kv
        self.needs_draft_probs = proposer is not None and proposer.needs_draft_probs
        self.requests: dict[str, CachedRequestState] = {}
        # Captured decodes by batch-size bucket (capture_decode_graphs); empty = always eager.
        self.decode_graphs: dict[int, DecodeGraph] = {}
        self.graph_replays = 0  # steps served by a replay (tests and the start-up log read it)
        self._cache_changed = False  # a finished request reached the proposer since the last report

    @staticmethod
    def seed_of(st: CachedRequestState) -> int | None:
        """A sampled request's seed (None: unseeded or greedy): its tokens then come from the
        race keyed by (seed, position), see sample/sampler.py."""
        p = st.params
        return None if p.seed is None or p.greedy else p.seed

    # -- the persistent batch ------------------------------------------------------------------
    def _apply(self, sched: SchedulerOutput) -> None:
        self.free(sched.finished_ids)
        for rid in sched.preempted_ids:
            self.requests.pop(rid, None)  # resumed later with its full data
        for nr in sched.new_requests:
            self.requests[nr.request_id] = self._new_state(nr)
        if sched.block_copies:
            self.copy_blocks(sched.block_copies)
        for cr in sched.cached_requests:
            st = self.requests[cr.request_id]
            st.block_ids.extend(cr.new_block_ids)
            if st.num_computed_tokens != cr.num_computed_tokens:
                raise RuntimeError(f"request {cr.request_id}: the worker has {st.num_computed_tokens} computed tokens, "
                                   f"the scheduler {cr.num_computed_tokens}")

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write of forked samples: the target's K/V of each source block into its
        destination, every layer. (The draft model recomputes its own K/V from the last
        shared block: the scheduler says so in ``num_draft_computed_tokens``.)"""
        src = torch.tensor([c[0] for c in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.long, device=self.device)
        for cache in self.kv_caches:  # (2, num_blocks, block_size, kv_heads, head_dim)
            cache.index_copy_(1, dst, cache.index_select(1, src))

    @staticmethod
    def _new_state(nr: NewRequestData) -> CachedRequestState:
        return CachedRequestState(nr.request_id, list(nr.token_ids), nr.num_prompt_tokens, nr.params,
                                  list(nr.block_ids), nr.num_computed_tokens,
                                  num_draft_seen=nr.num_draft_computed_tokens)

    def free(self, finished_ids: list[str]) -> None:
        """Drop finished requests' state (a step with nothing scheduled still reports them)."""
        proposer = self.proposer
        for rid in finished_ids:
            st = self.requests.pop(rid, None)
            if st is not None and proposer is not None:
                proposer.observe_finished(rid, st.token_ids, st.num_prompt_tokens)  # suffix decoding's global cache
                self._cache_changed = True

    # -- warm-up -------------------------------------------------------------------------------
    @torch.inference_mode()
    def warm_up(self, decode_batch_sizes: list[int], prefill_lens: list[int], prefill_batch_tokens: int = 0) -> None:
        """Run the forward, the logits and the sampler once per shape, so the kernels' one-time
        set-up per shape (oneDNN primitives, lazy initialisation) is paid now and not by the
        first requests. Writes K/V only into the first blocks, which are free and uncached at
        start-up (nothing reads them before a request owns and overwrites them)."""
        bs, num_blocks = self.block_size, self.kv_caches[0].shape[1]
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=0)
        # Prompt steps through the path real prompt steps take (``_forward`` with native
        # products where the plan allows them: oneDNN builds a bf16 primitive per shape on
        # first use): one sequence of n tokens from position 0, then the burst a server sees
        # first, sequences of 128 tokens filling ``prefill_batch_tokens``. Measured on 2 AVX-512
        # bf16 + AMX cores (PEERS shape, 16 x 128 tokens): the first such step took 254 ms and
        # the next two 225 and 207 ms after a warm-up that had run float32 forwards only.
        shapes = [[n] for n in prefill_lens]
        if prefill_batch_tokens >= 256:
            shapes.append([128] * (prefill_batch_tokens // 128))
        for lens in shapes:
            tables, first = [], 0
            for n in lens:
                nb = -(-n // bs)
                tables.append(list(range(first, first + nb)))
                first += nb
            if first > num_blocks:
                continue
            hidden = self._forward([0] * sum(lens), [p for n in lens for p in range(n)], lens, lens, tables,
                                   native=True)
            fast_argmax(self.model.compute_logits(hidden[-1:]), self.host)
        for b in decode_batch_sizes:  # b sequences of one new token after one in the cache
            if b > num_blocks:
                continue
            meta = self.attn_backend.build([1] * b, [2] * b, [[i] for i in range(b)])
            hidden = self.model(torch.zeros(b, dtype=torch.long, device=self.device),
                                torch.ones(b, dtype=torch.long, device=self.device), self.kv_caches, meta)
            logits = self.model.compute_logits(hidden)
            fast_argmax(logits, self.host)
            st = SamplingTensors.from_params([params] * b, self.arch.vocab_size, self.device,
                                             self.sampler.kernels)
            self.sampler.sample(logits, st, [None] * b)

    @torch.inference_mode()
    def profile_verification(self, batch_sizes: list[int], k_caps: list[int], context_tokens: int = 64,
                             repeats: int = 3) -> VerifyCostProfile:
        """What verification costs as it widens a step (``VerifyCostProfile``), measured now, at
        start-up: per batch size b (with its largest k), the forward of b sequences of 1 + k
        rows after ``context_tokens`` cached ones and their logits, then the verification
        (an argmax for greedy requests; for sampled ones, at temperature 1, the sampler or the
        rejection sampler against a flat q), and the proposer's round of k drafts for b
        requests, greedy and sampled. Each is the median of ``repeats`` rounds that take every
        k of a batch size in turn, after one untimed round: the controller reads ratios to
        k = 0, and the first calls after the kernels' threads idled run up to 3x slow (built-in
        target, batch 1, 2 AMD EPYC cores: 1.9, 1.0, 0.7, then 0.58 ms), which measured apart,
        k = 0 first, made k = 0 dearer than k = 1 and k = 2. Each step is timed where an engine
        runs it: off after off, verification after a draft round (at this size the draft's
        forward evicts some of the target's weights from cache). Writes K/V only into the
        first blocks, free at start-up (as ``warm_up``)."""
        bs, num_blocks = self.block_size, self.kv_caches[0].shape[1]
        sampled_params = SamplingParams(temperature=1.0)
        greedy_params = SamplingParams(temperature=0.0)
        cols: dict[str, list[tuple[int, int, float]]] = {"greedy": [], "sampled": [], "draft": [], "draft_sampled": []}
        for b, cap in zip(batch_sizes, k_caps):
            shapes = []
            for k in range(cap + 1):
                per_seq = -(-(context_tokens + 1 + k) // bs)
                if b * per_seq > num_blocks:
                    break
                shapes.append((k, [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]))
            st_t = SamplingTensors.from_params([sampled_params] * b, self.arch.vocab_size, self.device,
                                               self.sampler.kernels)
            times: dict[tuple[str, int], list[float]] = {}
            for r in range(repeats + 1):
                for k, tables in shapes:
                    # In the order a running engine meets them: an off step after off steps
                    # (the weights the draft evicted back in cache), a verification step
                    # after a draft round and a draft round after a verification step.
                    row = {}
                    if k == 0:
                        self._profile_step(tables, context_tokens, k, st_t)
                    elif self.proposer is not None:
                        row["draft"] = self.proposer.round_cost_s(tables, context_tokens + 1, k, greedy_params)
                    forward_s, greedy_s, sampled_s = self._profile_step(tables, context_tokens, k, st_t)
                    row.update(greedy=forward_s, sampled=forward_s - greedy_s + sampled_s)
                    if k and self.proposer is not None:
                        row["draft_sampled"] = self.proposer.round_cost_s(tables, context_tokens + 1, k, sampled_params)
                    if r:
                        for name, seconds in row.items():
                            times.setdefault((name, k), []).append(seconds)
            for (name, k), xs in times.items():
                cols[name].append((b, k, statistics.median(xs)))
        return VerifyCostProfile(tuple(cols["greedy"]), tuple(cols["draft"]), tuple(cols["sampled"]),
                                 tuple(cols["draft_sampled"]), self._profile_catch_up(4 * context_tokens, repeats))

    def _profile_catch_up(self, context_tokens: int, repeats: int) -> float:
        """The proposer's catch-up over a request's unseen context, seconds per token: the
        median of ``repeats`` timed catch-ups over ``context_tokens`` tokens (fewer where the
        cache is smaller) after one untimed, in the first blocks, free at start-up."""
        if self.proposer is None:
            return 0.0
        num_blocks = self.kv_caches[0].shape[1]
        n = min(context_tokens, num_blocks * self.block_size)
        table = list(range(-(-n // self.block_size)))
        times = [self.proposer.catch_up_cost_s(table, n) for _ in range(repeats + 1)][1:]
        return statistics.median(times) / n

    def _profile_step(self, tables: list[list[int]], context_tokens: int, k: int,
                      st_t: SamplingTensors) -> tuple[float, float, float]:
        """One timed step of ``len(tables)`` sequences of 1 + k rows: (forward with logits and
        argmax, the greedy verification alone, the sampled one alone)."""
        b, q = len(tables), 1 + k
        ctx = context_tokens + q
        positions = [p for _ in range(b) for p in range(context_tokens, ctx)]
        drafts = [[0] * k for _ in range(b)]
        flat_q = [torch.full((k, self.arch.vocab_size), 1.0 / self.arch.vocab_size, device=self.device)
                  for _ in range(b)]
        t0 = time.perf_counter()
        hidden = self._forward([0] * (b * q), positions, [q] * b, [ctx] * b, tables, False)
        logits = self.model.compute_logits(hidden)  # (b * q, V)
        fast_argmax(logits, self.host).tolist()
        t1 = time.perf_counter()
        if k:
            greedy_rows(logits, [k] * b, drafts, self.host)
        else:
            fast_argmax(logits, self.host).tolist()
        t2 = time.perf_counter()
        if k:
            self.rejection_sampler(logits, [k] * b, drafts, flat_q, st_t, [None] * b)
        else:
            self.sampler.sample(logits, st_t, [None] * b).tolist()
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2

    # -- captured decodes ----------------------------------------------------------------------
    @torch.inference_mode()
    def capture_decode_graphs(self, batch_sizes: list[int], scratch_slot: int) -> float:
        """Capture a decode per batch-size bucket (largest first, all in one memory pool, as
        the captures never run at once); returns the seconds it took. ``scratch_slot`` is a
        cache slot no request owns (the padding rows write there). On CUDA each is a CUDA
        graph; elsewhere a replay runs the same forward over the same static buffers (how the
        CPU tests check the padding and the buffer copies)."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        for b in sorted(set(batch_sizes), reverse=True):
            graph = DecodeGraph(self.model, self.kv_caches, self.attn_backend, b, scratch_slot, pool=pool)
            graph.capture()
            self.decode_graphs[b] = graph
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _graph_for(self, num_seqs: int) -> DecodeGraph | None:
        """The smallest captured bucket that holds ``num_seqs`` decodes (None: run eagerly)."""
        fits = [b for b in self.decode_graphs if b >= num_seqs]
        return self.decode_graphs[min(fits)] if fits else None

    # -- the step ------------------------------------------------------------------------------
    def _forward_in_groups(self, input_ids: list[int], positions: list[int], query_lens: list[int],
                           context_lens: list[int], tables: list[list[int]]) -> torch.Tensor:
        """One step's decode (or verification) rows as forwards of whole sequences, at most
        ``fused_rows`` rows each, so each goes through the fused decode layer: measured on 2
        AVX-512 bf16 cores (benchmarks/bench_kv_capacity.py, 20-32 sequences decoding), the
        per-operation path over 32 rows cost more than two fused passes over 16. Sequences are
        independent in a forward, so each row is what it would be in a batch of its group
        alone (and a request's output does not depend on how many decode beside it)."""
        groups, start, i = [], 0, 0
        while i < len(query_lens):
            j, rows = i, 0
            while j < len(query_lens) and rows + query_lens[j] <= self.fused_rows:
                rows += query_lens[j]
                j += 1
            meta = self.attn_backend.build(query_lens[i:j], context_lens[i:j], tables[i:j])
            ids_t = torch.tensor(input_ids[start : start + rows], dtype=torch.long, device=self.device)
            pos_t = torch.tensor(positions[start : start + rows], dtype=torch.long, device=self.device)
            groups.append((ids_t, pos_t, meta))
            start, i = start + rows, j
        return torch.cat(self.model.forward_groups(groups, self.kv_caches))

    def _forward(self, input_ids: list[int], positions: list[int], query_lens: list[int], context_lens: list[int],
                 tables: list[list[int]], native: bool) -> torch.Tensor:
        """One forward of these sequences, with native products for large batches when
        ``native`` (prompt rows only, where the plan allows them). Float32 rows of more than
        ``fused_rows`` in all, at most that many a sequence, go in groups through the fused
        layer. Native ones never do: a step of 15 prompt chunks of 16 tokens after prefix-cache
        hits took 42 ms as 15 fused groups, 22 ms as one native forward."""
        native = native and self.native_prefill is not None
        if not native and self.fused_rows and len(input_ids) > self.fused_rows \
                and max(query_lens) <= self.fused_rows:
            return self._forward_in_groups(input_ids, positions, query_lens, context_lens, tables)
        meta = self.attn_backend.build(query_lens, context_lens, tables)
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        with self.native_prefill(native) if self.native_prefill else contextlib.nullcontext():
            return self.model(ids_t, pos_t, self.kv_caches, meta)

    def _forward_mixed(self, input_ids: list[int], positions: list[int], query_lens: list[int],
                       context_lens: list[int], tables: list[list[int]], prompt_seq: list[bool]) -> torch.Tensor:
        """A step of prompt chunks beside decode (or verification) rows as two forwards: the
        prompt sequences' rows with native products, the others in float32 (through the fused
        layer where they fit), so decode rows are what a pure decode step gives them and prompt
        chunks what a pure prompt step gives them. Sequences are independent in a forward. On 2
        cores with AMX, bf16 products of prefill-sized batches ran 7-8x float32's (oneDNN), and
        the capacity benchmark's mixed steps were half its time (docs/benchmarks.md)."""
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        hidden = None
        for want in (True, False):
            idx = [i for i, p in enumerate(prompt_seq) if p is want]
            rows = [r for i in idx for r in range(starts[i], starts[i + 1])]
            h = self._forward([input_ids[r] for r in rows], [positions[r] for r in rows], [query_lens[i] for i in idx],
                              [context_lens[i] for i in idx], [tables[i] for i in idx], want)
            if hidden is None:
                hidden = h.new_empty((len(input_ids), h.shape[-1]))
            hidden[torch.tensor(rows, device=self.device)] = h
        return hidden

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step. Requests with draft tokens are verified: their last k+1 positions
        are sampled through the rejection sampler."""
        self._apply(sched)
        out = ModelRunnerOutput()
        if sched.is_empty:
            return out
        t0 = time.perf_counter()
        input_ids: list[int] = []
        query_lens, context_lens, tables = [], [], []
        positions: list[int] = []
        sample_rows: list[int] = []
        # (state, its first row in this batch, its first position, rows to score, prompt done)
        prompt_rows: list[tuple[CachedRequestState, int, int, int, bool]] = []
        sampled: list[CachedRequestState] = []
        num_drafts: list[int] = []
        drafts: list[list[int]] = []
        spec = False
        # A step of plain decodes only (one token each, no drafts to verify, no prompt rows)
        # can replay a captured graph.
        all_decode = bool(self.decode_graphs)
        # A step of prompt rows only (no decodes, drafts, recomputed outputs or scored prompts).
        prompt_only = self.native_prefill is not None
        # Per sequence: its rows are prompt rows only (the same test, one sequence at a time).
        prompt_seq: list[bool] = []
        for s in sched.scheduled:
            st = self.requests[s.request_id]
            d = list(s.draft_token_ids)
            n_real = s.num_tokens - len(d)
            input_ids.extend(st.token_ids[s.start_pos : s.start_pos + n_real])
            input_ids.extend(d)
            positions.extend(range(s.start_pos, s.start_pos + s.num_tokens))
            query_lens.append(s.num_tokens)
            context_lens.append(s.start_pos + s.num_tokens)
            tables.append(st.block_ids)
            if st.params.prompt_logprobs is not None and s.start_pos < st.num_prompt_tokens:
                # Row p predicts prompt token p + 1; the last prompt row predicts the first output.
                n_rows = min(s.start_pos + n_real, st.num_prompt_tokens - 1) - s.start_pos
                done = s.start_pos + n_real >= st.num_prompt_tokens
                prompt_rows.append((st, len(input_ids) - len(d) - n_real, s.start_pos, max(n_rows, 0), done))
            all_decode = all_decode and s.num_tokens == 1 and s.sample and not d and not prompt_rows
            prompt_seq.append(not d and s.start_pos + s.num_tokens <= st.num_prompt_tokens
                              and st.params.prompt_logprobs is None)
            prompt_only = prompt_only and prompt_seq[-1]
            if s.sample:
                k = len(d)
                spec |= k > 0
                sample_rows.extend(range(len(input_ids) - 1 - k, len(input_ids)))
                sampled.append(st)
                num_drafts.append(k)
                drafts.append(d)
        graph = self._graph_for(len(query_lens)) if all_decode else None
        if graph is not None:
            hidden = graph.replay(input_ids, context_lens, tables)  # (B, hidden): the real rows
            self.graph_replays += 1
        elif self.native_prefill is not None and not prompt_only \
                and sum(n for n, p in zip(query_lens, prompt_seq) if p) > CpuCompactWeightsLinearMethod.SMALL_BATCH:
            hidden = self._forward_mixed(input_ids, positions, query_lens, context_lens, tables, prompt_seq)
        else:
            hidden = self._forward(input_ids, positions, query_lens, context_lens, tables, prompt_only)
        if prompt_rows:
            self._prompt_logprobs(out, hidden, prompt_rows)
        if sampled:
            if len(sample_rows) < len(input_ids):
                hidden = hidden[torch.tensor(sample_rows, device=self.device)]
            logits = self.model.compute_logits(hidden)  # (rows, V) float32
            if sched.grammar is not None:
                self._apply_grammar(logits, sched.grammar, sampled, num_drafts)
            emitted, rows_of = self._sample(logits, sampled, num_drafts, drafts, spec)
            self._logprobs(out, logits, sampled, rows_of, emitted)
            for st, toks in zip(sampled, emitted):
                out.sampled_token_ids[st.request_id] = toks
        out.target_forward_s = time.perf_counter() - t0
        if self._cache_changed and self.proposer is not None:
            out.suffix_cache = self.proposer.cache_figures()
            self._cache_changed = False
        self._advance(sched, out)
        if self.proposer is not None:
            try:
                self._propose(sched, out)
            except Exception as e:  # the step's results are applied: it cannot be re-run
                raise StepAppliedError(f"{type(e).__name__} in the draft proposal: {e}") from e
        return out

    def _apply_grammar(self, logits: torch.Tensor, grammar: GrammarBitmask, sampled: list[CachedRequestState],
                       num_drafts: list[int]) -> None:
        """Mask the constrained requests' rows (each sampled position, drafts' included) in
        place: sampling, verification and logprobs all see the masked distribution."""
        rows: list[int] = []
        mask_rows: list[int] = []
        start = 0
        for st, k in zip(sampled, num_drafts):
            first = grammar.first_rows.get(st.request_id)
            if first is not None:
                rows.extend(range(start, start + k + 1))
                mask_rows.extend(range(first, first + k + 1))
            start += k + 1
        bitmask = grammar.array()  # waits for the engine core's thread if it is still filling
        if mask_rows != list(range(len(bitmask))):
            bitmask = bitmask[mask_rows]
        apply_token_bitmask(logits, rows, bitmask, self.sampler.kernels)

    def _sample(self, logits: torch.Tensor, sampled: list[CachedRequestState], num_drafts: list[int],
                drafts: list[list[int]], spec: bool) -> tuple[list[list[int]], list[list[int]]]:
        plist = [st.params for st in sampled]
        if any(p.has_logits_processors for p in plist):
            # Each request's last row (requests with processors have no drafts).
            ends = list(itertools.accumulate(k + 1 for k in num_drafts))
            logits = apply_logits_processors(logits, [e - 1 for e in ends], plist,
                                             [st.token_ids[: st.num_prompt_tokens] for st in sampled],
                                             [st.token_ids[st.num_prompt_tokens :] for st in sampled])
        if not spec:
            if all(p.greedy for p in plist):
                tokens = fast_argmax(logits, self.host)  # the common all-greedy case: nothing to prepare
            else:
                st_t = self._sampling_tensors.get(plist)
                keys = [None if (seed := self.seed_of(st)) is None else seeded_key(seed, len(st.token_ids))
                        for st in sampled]
                tokens = self.sampler.sample(logits, st_t, keys)
            return [[t] for t in tokens.tolist()], [[i] for i in range(len(sampled))]
        if self.synthetic_acceptance is not None:
            if all(p.greedy for p in plist):
                target = fast_argmax(logits, self.host).tolist()
            else:
                counts = [k + 1 for k in num_drafts]
                st_t = SamplingTensors.from_params(plist, self.arch.vocab_size, self.device,
                                                   self.sampler.kernels).repeat_rows(counts)
                target = self.sampler.sample(logits, st_t, [None] * len(st_t.greedy)).tolist()
            emitted = synthetic_rows(target, num_drafts, drafts, self.synthetic_acceptance, self.sampler.generator)
        elif all(p.greedy for p in plist):
            # Acceptance by argmax equality needs no sampling tensors and no draft q.
            emitted = greedy_rows(logits, num_drafts, drafts, self.host)
        else:
            st_t = self._sampling_tensors.get(plist)
            seeded = [None if (seed := self.seed_of(st)) is None else (seed, len(st.token_ids)) for st in sampled]
            probs = None
            if self.needs_draft_probs:
                probs = [st.draft_probs[:k] if k and st.draft_probs is not None else None
                         for st, k in zip(sampled, num_drafts)]
            emitted = self.rejection_sampler(logits, num_drafts, drafts, probs, st_t, seeded)
        starts = [0]
        for k in num_drafts:
            starts.append(starts[-1] + k + 1)
        return emitted, [list(range(s, s + len(e))) for s, e in zip(starts, emitted)]

    PROMPT_LOGPROB_ROWS = 256  # rows of logits at a time: (rows, V) float32 stays bounded

    def _prompt_logprobs(self, out: ModelRunnerOutput, hidden: torch.Tensor,
                         prompt_rows: list[tuple[CachedRequestState, int, int, int, bool]]) -> None:
        for st, first, start_pos, n_rows, done in prompt_rows:
            if start_pos == 0 or st.prompt_logprobs is None:  # a new prompt, or recomputed after preemption
                st.prompt_logprobs = [None]  # the first prompt token has nothing before it
            targets = st.token_ids[start_pos + 1 : start_pos + 1 + n_rows]
            k = st.params.prompt_logprobs
            for c in range(0, n_rows, self.PROMPT_LOGPROB_ROWS):
                rows = torch.arange(first + c, first + min(c + self.PROMPT_LOGPROB_ROWS, n_rows), device=self.device)
                logits = self.model.compute_logits(hidden[rows])
                tgt = torch.tensor(targets[c : c + len(rows)], device=self.device)
                st.prompt_logprobs.extend(Sampler.logprobs(logits, tgt, [k] * len(rows)))
            if done:
                out.prompt_logprobs[st.request_id] = st.prompt_logprobs
                st.prompt_logprobs = None

    def _logprobs(self, out: ModelRunnerOutput, logits: torch.Tensor, sampled: list[CachedRequestState],
                  rows_of: list[list[int]], emitted: list[list[int]]) -> None:
        for st, rows, toks in zip(sampled, rows_of, emitted):
            k = st.params.logprobs
            if k is not None:
                sel = logits[torch.tensor(rows, device=self.device)]
                out.logprobs[st.request_id] = Sampler.logprobs(sel, torch.tensor(toks, device=self.device),
                                                               [k] * len(toks))

    def _advance(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """Apply this step to the persistent state: computed tokens, sampled tokens, and the
        drafts consumed (verified, or dropped by the scheduler for lack of budget)."""
        uses_draft_kv = self.uses_draft_kv
        for s in sched.scheduled:
            st = self.requests[s.request_id]
            st.draft_token_ids = []
            st.draft_probs = None
            if not s.sample:
                st.num_computed_tokens += s.num_tokens
                continue
            toks = out.sampled_token_ids[s.request_id]
            k = len(s.draft_token_ids)
            computed, m = verified(s.num_tokens, k, len(toks))
            st.num_computed_tokens += computed
            st.token_ids.extend(toks)
            st.num_computed_tokens = min(st.num_computed_tokens, len(st.token_ids))
            if k and uses_draft_kv:
                # The draft chain wrote K/V for drafts 1..k-1; the accepted ones are now valid.
                st.num_draft_seen += min(m, k - 1)

    def _propose(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> None:
        if not any(s.num_lookahead_tokens for s in sched.scheduled):
            return  # speculation off this step; a draft model catches up when it is back on
        proposer = self.proposer
        assert proposer is not None
        uses_draft_model = self.uses_draft_kv
        bs = self.block_size
        inputs = []
        for s in sched.scheduled:
            st = self.requests[s.request_id]
            in_decode = st.num_computed_tokens >= st.num_prompt_tokens
            kk = 0
            if s.sample and s.num_lookahead_tokens:
                room = draft_room(st.params.max_tokens, st.num_output_tokens, self.max_model_len, len(st.token_ids))
                kk = max(min(s.num_lookahead_tokens, room), 0)
            if not uses_draft_model and kk <= 0:
                continue  # n-gram lookup has nothing to catch up on
            valid = len(st.token_ids) if in_decode else st.num_computed_tokens
            # The draft can only write K/V into slots the request already owns.
            valid = min(valid, len(st.block_ids) * bs)
            inputs.append(ProposalInput(st.request_id, st.token_ids, st.num_draft_seen, valid, st.block_ids, kk,
                                        st.params, self.seed_of(st)))
        if not inputs:
            return
        t0 = time.perf_counter()
        proposal = proposer.propose(inputs)
        for inp in inputs:
            st = self.requests[inp.request_id]
            d = proposal.draft_ids.get(inp.request_id, [])
            st.draft_token_ids = d
            st.num_draft_seen = proposal.num_seen.get(inp.request_id, st.num_draft_seen)
            if proposal.draft_probs is not None and inp.request_id in proposal.draft_probs:
                st.draft_probs = proposal.draft_probs[inp.request_id]
            if d:
                out.draft_token_ids[inp.request_id] = list(d)
            out.draft_caps[inp.request_id] = inp.k
            if uses_draft_model:
                out.num_draft_computed[inp.request_id] = st.num_draft_seen
        out.propose_s = time.perf_counter() - t0
        drafted = sum(1 for i in inputs if i.k > 0)
        if drafted and proposal.num_forwards:
            # Per step of a steady-state round (early stops make rounds shorter than k): the
            # whole proposal, overheads included. A catch-up over a prompt, or over what was
            # generated while speculation was off, is not observed: charged to its few steps
            # it made a draft forward look ten times dearer, and the controller then kept
            # speculation off.
            out.draft_step_s = out.propose_s / proposal.num_forwards
            out.num_drafting = drafted
