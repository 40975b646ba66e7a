"""Draft proposers: a small draft model with its own paged KV cache, or n-gram prompt lookup.

Both implement ``propose(inputs) -> Proposal``. The engine calls it at the end of a step for
every running request: each input carries the tokens the proposer has not seen yet (so a
draft model catches up on what was accepted last round, or on a prefill chunk) and how many
drafts to make (``k``, 0 = catch up only).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from tailserve.attention.backend import AttentionBackend, upcasts_attention
from tailserve.attention.reference import build_attention_metadata, decode_metadata
from tailserve.model.config import ModelArchConfig
from tailserve.model.llama import LlamaFamilyModel
from tailserve.sample.sampler import (
    SamplingTensorsCache,
    SeededNoise,
    fast_argmax,
    filtered_probs,
    row_uniforms,
    sample_from_probs,
    seeded_key,
)
from tailserve.sampling_params import SamplingParams
from tailserve.speculative.draft_step import DraftStep, NumpyStepAdapter, TorchDraftStep
from tailserve.speculative.numpy_draft import NumpyDraftStep

if TYPE_CHECKING:
    from tailserve.speculative.suffix import SuffixCacheFigures


@dataclass
class ProposalInput:
    request_id: str
    all_token_ids: list[int]  # the request's whole sequence so far (prompt + outputs)
    num_seen: int  # tokens whose K/V the proposer already holds (draft model)
    num_valid: int  # tokens it may consume now (num_tokens, or num_computed mid-prefill)
    block_ids: list[int]
    k: int
    params: SamplingParams
    seed: int | None  # a seeded sampled request's seed: its drafts are its races' winners under q


@dataclass
class Proposal:
    draft_ids: dict[str, list[int]]
    draft_probs: dict[str, torch.Tensor] | None  # (k, V) per request; None = one-hot (n-gram)
    num_seen: dict[str, int]  # tokens whose K/V the proposer now holds, per request
    # Steps this proposal took (draft-model forwards; for lookup, the drafts asked for), for
    # the adaptive controller's cost per step. None: not a steady-state round (a catch-up
    # over a prompt or many tokens), whose time says nothing about the next round's.
    num_forwards: int | None = None


class Proposer(Protocol):
    """What the model runner calls, and what a proposer declares about itself once (the
    runner never asks its type): whether a draft model's K/V must follow the accepted tokens
    (``uses_draft_kv``), and whether its drafts come with q for the rejection sampler
    (``needs_draft_probs``; one-hot q is implied otherwise)."""

    uses_draft_kv: bool
    needs_draft_probs: bool

    def propose(self, inputs: list[ProposalInput]) -> Proposal: ...

    def observe_finished(self, request_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        """A request finished with these tokens (suffix decoding caches them; a lookup drops
        its copy of the request's tokens; a draft model ignores it)."""

    def cache_figures(self) -> SuffixCacheFigures | None:
        """Suffix decoding's global cache (None: this proposer keeps none)."""

    def round_cost_s(self, block_ids: list[list[int]], context_tokens: int, k: int,
                     params: SamplingParams | None = None) -> float:
        """Seconds of one steady round of ``k`` drafts for ``len(block_ids)`` requests of
        ``context_tokens`` tokens with these sampling parameters (default greedy), one timed
        round now (at start-up: it may write K/V into these blocks; the caller repeats it);
        where drafting has several sources, the least a round can cost (0 for lookups)."""

    def catch_up_cost_s(self, block_ids: list[int], context_tokens: int) -> float:
        """Seconds of one timed catch-up over ``context_tokens`` tokens the proposer has never
        seen, for one request (a draft model's prefill of them and its first draft; at
        start-up it writes K/V into these blocks); the least it can cost where drafting has
        several sources (0 for lookups)."""


class LookupProposer:
    """A proposer that looks drafts up in text (``propose_one(tokens, k)``): no model, one-hot
    q, nothing to catch up on. The n-gram and suffix proposers share this.

    Each request's tokens are kept as a NumPy array grown by what each step added: at a
    7,000-token context (2 Xeon cores) a suffix proposal from the list took 155 us, 100 of them
    converting the whole list, on every step that drafts or tries to (a decode step there is
    ~1.25 ms); from the kept array, 45 us."""

    uses_draft_kv = False
    needs_draft_probs = False
    # Copies kept at most (a request preempted and then aborted is never reported finished
    # here): past this many, all are dropped and rebuilt as needed.
    MAX_TOKEN_COPIES = 4096

    def __init__(self) -> None:
        self._copies: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (buffer, tokens in it)

    def propose_one(self, tokens: list[int] | np.ndarray, k: int) -> list[int]:
        raise NotImplementedError

    def tokens_of(self, inp: ProposalInput) -> np.ndarray:
        """The request's first ``num_valid`` tokens as int64, from its copy plus what is new."""
        toks, want = inp.all_token_ids, inp.num_valid
        held = self._copies.get(inp.request_id)
        if held is not None:
            buf, n = held
            if n <= want and (n == 0 or buf[n - 1] == toks[n - 1]):  # the same sequence, grown
                if want > n:
                    if want > len(buf):
                        grown = np.empty(2 * want, dtype=np.int64)
                        grown[:n] = buf[:n]
                        buf = grown
                    buf[n:want] = toks[n:want]
                    self._copies[inp.request_id] = (buf, want)
                return buf[:want]
        if len(self._copies) >= self.MAX_TOKEN_COPIES:
            self._copies.clear()
        buf = np.empty(max(2 * want, 64), dtype=np.int64)
        buf[:want] = toks[:want]
        self._copies[inp.request_id] = (buf, want)
        return buf[:want]

    def propose_input(self, inp: ProposalInput) -> list[int]:
        if inp.k <= 0:
            return []
        return self.propose_one(self.tokens_of(inp), inp.k)

    def forget(self, request_id: str) -> None:
        self._copies.pop(request_id, None)

    def round_cost_s(self, block_ids: list[list[int]], context_tokens: int, k: int,
                     params: SamplingParams | None = None) -> float:
        return 0.0  # a lookup per request: microseconds beside a forward

    def catch_up_cost_s(self, block_ids: list[int], context_tokens: int) -> float:
        return 0.0  # nothing to catch up on

    def propose(self, inputs: list[ProposalInput]) -> Proposal:
        drafts = {i.request_id: self.propose_input(i) for i in inputs}
        return Proposal(drafts, None, {i.request_id: i.num_valid for i in inputs},
                        num_forwards=max((i.k for i in inputs), default=0) or None)


class NgramProposer(LookupProposer):
    """Prompt lookup: find the most recent earlier occurrence of the context's last n tokens
    (n from ngram_max down to ngram_min) and propose what followed it."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        super().__init__()
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose_one(self, tokens: list[int] | np.ndarray, k: int) -> list[int]:
        if k <= 0:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        n_tok = len(arr)
        for n in range(min(self.ngram_max, n_tok - 1), self.ngram_min - 1, -1):
            suffix = arr[n_tok - n :]
            windows = np.lib.stride_tricks.sliding_window_view(arr[: n_tok - 1], n)  # starts 0 .. n_tok-1-n
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            hits = hits[hits < n_tok - n]  # an earlier occurrence, not the suffix itself
            if hits.size:
                start = int(hits[-1]) + n
                cont = arr[start : start + k].tolist()
                if cont:
                    return cont
        return []

    def observe_finished(self, request_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        self.forget(request_id)

    def cache_figures(self) -> SuffixCacheFigures | None:
        return None


# The chain's fast metadata also serves catch-ups of up to this many tokens per row.
_CHAIN_MAX_CATCH_UP = 2


@dataclass
class _Chain:
    """One round's tables for the draft chain (built by ``_chain_slots``)."""

    row_of: dict[str, int]  # request id -> row
    lens: list[int]  # sequence length per row at the start of the round
    cos: torch.Tensor  # (B, steps + _CHAIN_MAX_CATCH_UP, D) rotary tables by column
    sin: torch.Tensor
    slot_table: Callable[[], torch.Tensor]  # (B, W) KV slot of every position a step can touch

    @functools.cached_property
    def table(self) -> torch.Tensor:
        """Built on first use: only the reference's metadata and a single sequence's own step
        read it (the CPU decode backend builds its metadata from the block ids)."""
        return self.slot_table()


class DraftModelProposer:
    """A small model of the same vocabulary proposes k tokens autoregressively.

    Its KV cache has the same block layout as the target's and is indexed by the same block
    ids, so it needs no allocator of its own: a request's blocks hold both models' K/V.
    The first forward of a round is the catch-up (what was accepted last round, or a prefill
    chunk, for every request at once); then up to k-1 single-token forwards for the requests
    that draft. q is the draft's distribution after the request's own sampling filters, which
    is what the rejection sampler needs for losslessness.

    A request's chain stops early after a draft the draft model itself was unsure of: when
    the margin between its two most likely tokens (in q, or the plain softmax for greedy
    requests) is below ``stop_margin``. Such drafts are mostly rejected, so the forwards
    after them would be wasted, and the verification gets shorter too. The rule looks only
    at the draft's own numbers, never at the target's, so sampling stays exact: the number
    of drafts is decided before verification, like a per-round k.
    """

    uses_draft_kv = True
    needs_draft_probs = True

    def __init__(self, model: LlamaFamilyModel, arch: ModelArchConfig, kv_caches: list[torch.Tensor],
                 block_size: int, device: torch.device, generator: torch.Generator,
                 stop_margin: float = 0.0, single_step: DraftStep | None = None,
                 attn_backend: AttentionBackend | None = None, scratch_slot: int | None = None,
                 sampling_kernels=None, batched_single_rows: bool | None = None) -> None:
        self.model, self.arch, self.kv_caches = model, arch, kv_caches
        # A cache slot outside every request's blocks: where a ragged catch-up's padding
        # tokens write their K/V, so the cached values they repeat stay bitwise as they were.
        self.scratch_slot = scratch_slot
        # A backend for the batched forwards (the CPU's decode kernel); None: the reference's
        # metadata, and for the chain the slot tables computed once per round.
        self.attn_backend = attn_backend
        self.block_size, self.device, self.generator = block_size, device, generator
        self.host = device.type == "cpu"  # fast_argmax's NumPy path
        self.noise = SeededNoise(sampling_kernels)  # seeded rows' races (sample/sampler.py)
        self.sampling_kernels = sampling_kernels  # kernels.cpu.CpuKernels where the plan runs them
        self._sampling_tensors = SamplingTensorsCache(arch.vocab_size, device, sampling_kernels)
        self.stop_margin = stop_margin
        self.upcast = upcasts_attention(device)
        # A single sequence's chain steps (see draft_step.py): PyTorch, or NumPy on the CPU.
        self.single_step: DraftStep = single_step or TorchDraftStep(model, kv_caches, device)
        # Whether a one-row chain step also goes through the batched path (the backend's
        # kernel): the plan's chain step "batched". Default: where a backend is given and
        # the single step is not NumPy's.
        if batched_single_rows is None:
            batched_single_rows = attn_backend is not None and not isinstance(self.single_step, NumpyStepAdapter)
        self.batched_single_rows = batched_single_rows
        # A round of drafts in one compiled call (FusedDecodeModel.draft_rounds) where its
        # steps would go through the fused model anyway: the CPU decode backend, batched single
        # rows, no sliding window.
        fused = model.fused_decode
        self._compiled_chain = bool(batched_single_rows and attn_backend is not None and fused is not None
                                    and fused.head is not None and arch.sliding_window is None
                                    and model.rotary.cos.dtype == torch.float32 and model.rotary.cos.is_contiguous())
        self._block_offsets: torch.Tensor | None = None

    @property
    def numpy_step(self) -> NumpyDraftStep | None:
        """The NumPy step when a single sequence's steps run in NumPy, else None."""
        return self.single_step.step if isinstance(self.single_step, NumpyStepAdapter) else None

    @property
    def num_numpy_forwards(self) -> int:
        """Chain steps run in NumPy so far (for tests and benchmarks)."""
        return self.single_step.num_forwards if isinstance(self.single_step, NumpyStepAdapter) else 0

    @torch.inference_mode()
    def observe_finished(self, request_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        return None

    def cache_figures(self) -> SuffixCacheFigures | None:
        return None

    @torch.inference_mode()
    def round_cost_s(self, block_ids: list[list[int]], context_tokens: int, k: int,
                     params: SamplingParams | None = None) -> float:
        """One steady round, timed (``propose`` after one accepted token a request: the
        catch-up forward, then the chain; q and the draws for sampled ``params``), with the
        stop margin off so that all ``k`` drafts are made. The caller repeats and takes the
        median (``ModelRunner.profile_verification``)."""
        params = params or SamplingParams(temperature=0.0)
        inputs = [ProposalInput(f"profile-{i}", [0] * context_tokens, context_tokens - 1, context_tokens, table, k,
                                params, None) for i, table in enumerate(block_ids)]
        margin, self.stop_margin = self.stop_margin, 0.0
        try:
            t0 = time.perf_counter()
            self.propose(inputs)
            return time.perf_counter() - t0
        finally:
            self.stop_margin = margin

    @torch.inference_mode()
    def catch_up_cost_s(self, block_ids: list[int], context_tokens: int) -> float:
        inp = ProposalInput("profile-catch-up", [0] * context_tokens, 0, context_tokens, block_ids, 1,
                            SamplingParams(temperature=0.0), None)
        t0 = time.perf_counter()
        self.propose([inp])
        return time.perf_counter() - t0

    def propose(self, inputs: list[ProposalInput]) -> Proposal:
        seen = {i.request_id: i.num_seen for i in inputs}
        drafts: dict[str, list[int]] = {i.request_id: [] for i in inputs}
        probs: dict[str, list[torch.Tensor]] = {i.request_id: [] for i in inputs}
        catch_up = [i for i in inputs if i.num_valid > i.num_seen]
        if not catch_up:
            return Proposal(drafts, {}, seen)
        # 1. Catch-up forward: every request's unseen tokens; sample the first draft of the
        #    requests whose sequence ends here (num_valid == all tokens) and that want k >= 1.
        chain = None
        q = max(i.num_valid - i.num_seen for i in catch_up)
        steady = q <= _CHAIN_MAX_CATCH_UP and all(
            i.k > 0 and i.num_valid == len(i.all_token_ids) >= q for i in catch_up)
        if steady and (self.arch.sliding_window is not None or self.scratch_slot is None):
            # Padding needs the scratch slot and the chain's own metadata (a sliding-window
            # draft takes the general builder): ragged rounds go the general way there.
            steady = all(i.num_valid - i.num_seen == q for i in catch_up)
        if steady:
            pad = [q - (i.num_valid - i.num_seen) for i in catch_up]
            if self._compiled_chain:
                # The whole round in one compiled call, the same forwards as the steps below
                # (see _compiled_rounds).
                got = self._compiled_rounds(catch_up, [i.all_token_ids[-q:] for i in catch_up],
                                            [len(i.all_token_ids) - q for i in catch_up], pad,
                                            [i.k for i in catch_up], [0] * len(catch_up))
                if got is not None:
                    for i, d in zip(catch_up, got[0]):
                        seen[i.request_id] = i.num_valid
                        drafts[i.request_id] = d
                    return Proposal(drafts, got[1], seen, num_forwards=max(len(d) for d in got[0]))
            # The usual catch-ups: one token after a rejection, two (the last draft and the
            # bonus) after a fully accepted round. Rows that need fewer than the longest are
            # fed their last q tokens all the same (the extra ones were seen already): one
            # batched chain forward instead of the general path. The extra tokens write their
            # K/V to the scratch slot, so the cache keeps the values first computed for them
            # and a row's drafts do not depend on what shares its round.
            chain = self._chain_slots(catch_up)
            logits = self._chain_forward(catch_up, chain, 0, [t for i in catch_up for t in i.all_token_ids[-q:]], q,
                                         pad=pad if any(pad) else None)
        else:
            logits = self._forward(
                [i.all_token_ids[i.num_seen : i.num_valid] for i in catch_up],
                [i.num_seen for i in catch_up], [i.block_ids for i in catch_up],
                sample_last=[i.k > 0 and i.num_valid == len(i.all_token_ids) for i in catch_up])
        for i in catch_up:
            seen[i.request_id] = i.num_valid
        active = [i for i in catch_up if i.k > 0 and i.num_valid == len(i.all_token_ids)]
        stopped: set[str] = set()
        self._sample_into(active, logits, drafts, probs, stopped)
        # 2. Up to k-1 more single-token forwards for the requests still drafting. Their
        #    context slots are computed once for the whole chain; each step slices them.
        step = 1
        while True:
            active = [i for i in active if i.k > step and i.request_id not in stopped]
            if not active:
                break
            if self._compiled_chain:
                # The rest of the chain in one compiled call, the same forwards as the steps below.
                got = self._compiled_rounds(active, [drafts[i.request_id][-1:] for i in active],
                                            [len(i.all_token_ids) + step - 1 for i in active], [0] * len(active),
                                            [i.k - step for i in active], [len(drafts[i.request_id]) for i in active])
                if got is not None:
                    for i, d in zip(active, got[0]):
                        drafts[i.request_id].extend(d)
                        if i.request_id in got[1]:
                            probs[i.request_id].extend(got[1][i.request_id].unbind(0))
                    step += max(len(d) for d in got[0])
                    break
            if chain is None:
                chain = self._chain_slots(active)
            logits = self._chain_forward(active, chain, step, [drafts[i.request_id][-1] for i in active])
            self._sample_into(active, logits, drafts, probs, stopped)
            step += 1
        # The chain wrote K/V for the drafts it fed back in; they become "seen" only once
        # accepted, which the engine reports back through num_seen on the next round.
        out_probs = {rid: torch.stack(ps) for rid, ps in probs.items() if ps}
        return Proposal(drafts, out_probs, seen, num_forwards=step if steady else None)

    def _compiled_rounds(self, rows: list[ProposalInput], ids: list[list[int]], first_pos: list[int],
                         pads: list[int], steps: list[int], drafted: list[int]
                         ) -> tuple[list[list[int]], dict[str, torch.Tensor]] | None:
        """Up to ``steps[r]`` drafts for each of ``rows`` in one compiled call
        (``FusedDecodeModel.draft_rounds``): row r is fed ``ids[r]`` from ``first_pos[r]`` (its
        first ``pads[r]`` repeat cached tokens: their K/V go to the scratch slot), then each of
        its drafts; ``drafted[r]``: drafts it made this round before these (a seeded race's
        position). Greedy drafts are the steps' own (the argmax of the same logits). A sampled
        draft's q is ``filtered_probs``' rule (temperature, top-k, top-p, min-p) computed in the
        call, not PyTorch's bits: the draft is drawn from that q and verified against it, and a
        seeded request's output is its race under the target's p whatever was drafted. Returns
        (drafts per row, q rows per sampled request); None (the steps below instead) where the
        rows or positions do not fit the call."""
        fused = self.model.fused_decode
        kmax = max(steps)
        modes, uniforms, keys = [], None, None
        for r, (i, n) in enumerate(zip(rows, drafted)):
            if i.params.greedy:
                modes.append(fused.GREEDY)
            elif i.seed is not None:
                modes.append(fused.SEEDED)
                if keys is None:
                    keys = np.zeros((len(rows), kmax), dtype=np.uint64)
                keys[r, : steps[r]] = [seeded_key(i.seed, len(i.all_token_ids) + n + j) for j in range(steps[r])]
            else:
                modes.append(fused.SAMPLED)
                if uniforms is None:
                    uniforms = torch.rand((len(rows), kmax), generator=self.generator, dtype=torch.float64).numpy()
        got = fused.draft_rounds(ids, first_pos, pads, steps, [i.block_ids for i in rows], self.model.rotary,
                                 self.kv_caches, self.stop_margin, modes, [i.params.temperature for i in rows],
                                 [i.params.effective_top_k or 0 for i in rows], [i.params.top_p for i in rows],
                                 [i.params.min_p for i in rows], uniforms, keys,
                                 self.scratch_slot if self.scratch_slot is not None else 0)
        if got is None:
            return None
        out, q = got
        if q is None:
            return out, {}
        return out, {i.request_id: qr for i, m, d, qr in zip(rows, modes, out, q) if m != fused.GREEDY and d}

    def _chain_slots(self, active: list[ProposalInput]) -> _Chain:
        """Per-round tables for the chain steps: step s >= 1 feeds draft s at position
        len + s - 1; step 0 is the catch-up of the sequence's last tokens, ending at
        position len - 1."""
        bs = self.block_size
        lens = [len(i.all_token_ids) for i in active]

        def slot_table() -> torch.Tensor:
            width = max(n + i.k - 1 for n, i in zip(lens, active))
            nblocks = -(-width // bs)
            # Unused tail entries point at block 0: they are masked (ragged rows) or never read.
            blocks = torch.tensor([i.block_ids[:nblocks] + [0] * (nblocks - len(i.block_ids[:nblocks]))
                                   for i in active], dtype=torch.long, device=self.device)  # (B, nblocks)
            if self._block_offsets is None:
                self._block_offsets = torch.arange(bs, dtype=torch.long, device=self.device)
            return (blocks[:, :, None] * bs + self._block_offsets).view(len(active), -1)[:, :width]

        # Rotary cos/sin for every position a step can feed, looked up once per round:
        # column c of row r is position len_r - _CHAIN_MAX_CATCH_UP + c.
        steps = max(i.k for i in active)
        rotary = self.model.rotary
        ncols, npos = steps + _CHAIN_MAX_CATCH_UP, rotary.cos.shape[0]
        first0 = lens[0] - _CHAIN_MAX_CATCH_UP
        if len(active) == 1 and first0 >= 0 and first0 + ncols <= npos:
            # One row: its columns are consecutive positions, a slice of the tables.
            cos, sin = rotary.cos[first0 : first0 + ncols][None], rotary.sin[first0 : first0 + ncols][None]
        else:
            first = torch.tensor(lens, dtype=torch.long, device=self.device) - _CHAIN_MAX_CATCH_UP
            # Clamped: a row near the context limit drafts fewer tokens than the round's
            # longest, and its columns past its own last step are never read.
            cols = (first[:, None] + torch.arange(ncols, device=self.device)).clamp(0, npos - 1)
            cos, sin = rotary.cos[cols], rotary.sin[cols]
        return _Chain({i.request_id: r for r, i in enumerate(active)}, lens, cos, sin, slot_table)

    def _chain_forward(self, active: list[ProposalInput], chain: _Chain, step: int, tokens: list[int],
                       query_len: int = 1, pad: list[int] | None = None) -> torch.Tensor:
        """One forward of the chain: ``query_len`` tokens per active row (row-major in
        ``tokens``), ending at position len + step - 1; logits of each row's last token,
        in the model's dtype (greedy drafts take their argmax; sampling converts)."""
        sel = [chain.row_of[i.request_id] for i in active]
        ctx = [chain.lens[r] + step for r in sel]  # context after this step's tokens
        if self.arch.sliding_window is not None:
            # decode_metadata has no window: a sliding-window draft takes the general builder.
            return self._forward([tokens[r * query_len:(r + 1) * query_len] for r in range(len(active))],
                                 [c - query_len for c in ctx], [i.block_ids for i in active],
                                 sample_last=[True] * len(active))
        width = max(ctx)
        c0 = step + _CHAIN_MAX_CATCH_UP - query_len  # rotary column of each row's first token
        if len(sel) == 1 and not self.batched_single_rows:
            r = sel[0]
            return self.single_step.forward(tokens, chain.table[r, : ctx[0]], chain.cos[r, c0 : c0 + query_len, None],
                                            chain.sin[r, c0 : c0 + query_len, None])
        rows = None if len(sel) == len(chain.row_of) else torch.tensor(sel, device=self.device)
        cos_t, sin_t = (chain.cos, chain.sin) if rows is None else (chain.cos[rows], chain.sin[rows])
        cos = cos_t[:, c0 : c0 + query_len].reshape(-1, 1, cos_t.shape[-1])  # (B*Q, 1, D)
        sin = sin_t[:, c0 : c0 + query_len].reshape(-1, 1, sin_t.shape[-1])
        if self.attn_backend is not None:
            meta = self.attn_backend.build([query_len] * len(active), ctx, [i.block_ids for i in active])
        else:
            table = chain.table if rows is None else chain.table[rows]
            kv_slots = table[:, :width]
            positions = torch.tensor([c - query_len + j for c in ctx for j in range(query_len)], dtype=torch.long,
                                     device=self.device)
            slot_mapping = kv_slots.gather(1, positions.view(len(sel), query_len)).view(-1)
            uniform = all(c == width for c in ctx)
            meta = decode_metadata(slot_mapping, kv_slots, None if uniform else
                                   torch.tensor(ctx, dtype=torch.long, device=self.device), query_len, self.upcast)
        if pad is not None and self.scratch_slot is not None:
            # Row r's first pad[r] tokens only repeat cached ones: their writes go to scratch.
            for r, n in enumerate(pad):
                if n:
                    meta.slot_mapping[r * query_len : r * query_len + n] = self.scratch_slot
        if not cos.is_contiguous():
            # A step of one token per row slices every row's column: the fused layers take
            # contiguous tables (non-contiguous ones sent a batched chain step op by op).
            cos, sin = cos.contiguous(), sin.contiguous()
        fused = self.model.fused_decode
        if fused is not None:
            # The whole draft forward in one compiled call (model/llama.py FusedDecodeModel).
            got = fused.run(np.asarray(tokens, dtype=np.int64), (cos, sin), self.kv_caches, meta, query_len,
                            head=True)
            if got is not None:
                hidden, logits = got
                return logits if logits is not None else self.model.compute_logits(hidden, upcast=False)
        # Positions only select rotary rows, which this round already looked up.
        hidden = self.model.forward(torch.tensor(tokens, device=self.device), None, self.kv_caches, meta,
                                    rope=(cos, sin))
        if query_len > 1:
            hidden = hidden[query_len - 1 :: query_len]
        return self.model.compute_logits(hidden, upcast=False)

    def _forward(self, token_lists: list[list[int]], starts: list[int], tables: list[list[int]],
                 sample_last: list[bool]) -> torch.Tensor | None:
        ids, pos, qlens, ctx, rows = [], [], [], [], []
        for toks, start, want in zip(token_lists, starts, sample_last):
            ids.extend(toks)
            pos.extend(range(start, start + len(toks)))
            qlens.append(len(toks))
            ctx.append(start + len(toks))
            if want:
                rows.append(len(ids) - 1)
        if self.attn_backend is not None:
            meta = self.attn_backend.build(qlens, ctx, tables)
        else:
            meta = build_attention_metadata(qlens, ctx, tables, self.block_size, self.arch.sliding_window,
                                            self.device, self.upcast)
        hidden = self.model(torch.tensor(ids, device=self.device), torch.tensor(pos, device=self.device),
                            self.kv_caches, meta)
        if not rows:
            return None
        if len(rows) < len(ids):
            hidden = hidden[torch.tensor(rows, device=self.device)]
        return self.model.compute_logits(hidden)

    def _sample_into(self, active: list[ProposalInput], logits: torch.Tensor | None,
                     drafts: dict[str, list[int]], probs: dict[str, list[torch.Tensor]],
                     stopped: set[str]) -> None:
        """Append one draft per active row; add to ``stopped`` the rows whose draft fell
        under the stop margin."""
        if not active or logits is None:
            return
        stop = self.stop_margin > 0 and logits.shape[-1] >= 2
        if all(i.params.greedy for i in active):
            # Greedy verification compares tokens only; q is not needed.
            if not stop:
                for i, tok in zip(active, fast_argmax(logits, self.host).tolist()):
                    drafts[i.request_id].append(tok)
                return
            if self.sampling_kernels is not None and logits.dtype == torch.float32:
                # One pass per row (~40 us of softmax and topk a chain step otherwise).
                tokens, margins = self.sampling_kernels.top2_margin(logits)
            else:
                top = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(2, dim=-1)  # (N, 2)
                tokens, margins = top.indices[:, 0].tolist(), (top.values[:, 0] - top.values[:, 1]).tolist()
            for i, tok, margin in zip(active, tokens, margins):
                drafts[i.request_id].append(tok)
                if margin < self.stop_margin:
                    stopped.add(i.request_id)
            return
        st = self._sampling_tensors.get([i.params for i in active])
        q = filtered_probs(logits, st)  # (N, V)
        uniform = row_uniforms(len(active), self.generator, self.device)
        if self.sampling_kernels is not None:  # the plan's compiled CPU kernels: the same tokens in one call
            sampled = self.sampling_kernels.inverse_cdf(q.contiguous(), uniform)
        else:
            sampled = sample_from_probs(q, uniform)
        seeded = [row for row, i in enumerate(active) if i.seed is not None and not i.params.greedy]
        if seeded:
            # A seeded row proposes its race's winner under q with the noise of the position
            # the draft would take: verification races p with the same noise (a coupling).
            keys = [seeded_key(active[r].seed, len(active[r].all_token_ids) + len(drafts[active[r].request_id]))
                    for r in seeded]  # type: ignore[arg-type]
            idx = torch.tensor(seeded, device=self.device)
            sampled[idx] = self.noise.race(q[idx], keys).to(sampled.device)
        if st.any_greedy:  # as Sampler.sample: argmax only where a row takes it
            sampled = torch.where(st.greedy, fast_argmax(logits, self.host), sampled)
        tokens = sampled.tolist()
        if stop:
            # Greedy rows' q is the plain softmax: the same margin as the all-greedy path.
            top = q.topk(2, dim=-1).values
            margins = (top[:, 0] - top[:, 1]).tolist()
        for row, (i, tok) in enumerate(zip(active, tokens)):
            drafts[i.request_id].append(tok)
            probs[i.request_id].append(q[row])
            if stop and margins[row] < self.stop_margin:
                stopped.add(i.request_id)


class HybridProposer:
    """Lookups first (suffix decoding, then n-gram prompt lookup), the draft model where
    they find nothing.

    For each drafting request, the first lookup with a match supplies the drafts (free, and
    long runs in repetitive text such as code); the other requests draft with the model. A
    request drafted by lookup skips the draft model this round: the model catches up on its
    tokens lazily, in one multi-token forward, the next time it drafts for it. Lookup drafts
    go to the rejection sampler with a one-hot q, so sampling stays exact in a batch that
    mixes both kinds.
    """

    uses_draft_kv = True
    needs_draft_probs = True

    def __init__(self, draft: DraftModelProposer, lookups: list, vocab_size: int) -> None:
        """``lookups``: proposers with ``propose_input(ProposalInput) -> drafts``, tried in order."""
        self.draft, self.lookups, self.vocab_size = draft, lookups, vocab_size
        self.num_lookup_drafts = 0  # rounds drafted by lookup (for benchmarks and tests)
        self.num_model_drafts = 0  # rounds drafted by the model

    def propose(self, inputs: list[ProposalInput]) -> Proposal:
        looked_up: dict[str, list[int]] = {}
        rest = []
        for i in inputs:
            if i.k > 0:
                d = next((d for d in (lk.propose_input(i) for lk in self.lookups) if d), None)
                if d:
                    looked_up[i.request_id] = d
                    continue
            rest.append(i)
        proposal = self.draft.propose(rest) if rest else Proposal({}, {}, {})
        self.num_lookup_drafts += len(looked_up)
        model_drafts = sum(1 for i in rest if i.k > 0)
        self.num_model_drafts += model_drafts
        if not model_drafts and looked_up:
            proposal.num_forwards = max(len(d) for d in looked_up.values())
        probs = dict(proposal.draft_probs or {})
        for i in inputs:
            d = looked_up.get(i.request_id)
            if d is None:
                continue
            proposal.draft_ids[i.request_id] = d
            proposal.num_seen[i.request_id] = i.num_seen  # the model has not seen these tokens yet
            if not i.params.greedy:
                q = torch.zeros((len(d), self.vocab_size), device=self.draft.device)
                q[torch.arange(len(d)), torch.tensor(d)] = 1.0
                probs[i.request_id] = q
        return Proposal(proposal.draft_ids, probs, proposal.num_seen, proposal.num_forwards)

    def observe_finished(self, request_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        for lk in self.lookups:
            lk.observe_finished(request_id, token_ids, num_prompt_tokens)

    def round_cost_s(self, block_ids: list[list[int]], context_tokens: int, k: int,
                     params: SamplingParams | None = None) -> float:
        return 0.0  # a lookup may supply every draft: the least a round costs

    def catch_up_cost_s(self, block_ids: list[int], context_tokens: int) -> float:
        return 0.0  # a lookup may supply every draft: the draft model then never catches up

    def cache_figures(self) -> SuffixCacheFigures | None:
        return next((f for f in (lk.cache_figures() for lk in self.lookups) if f is not None), None)
