"""Turns a ``SchedulerOutput`` into one forward pass and sampled tokens.

All scheduled work of a step (prefill chunks and decodes) is one flat batch of tokens. The
runner builds the inputs and attention metadata, runs the model, computes logits only at
the positions that sample, and samples. It keeps per-request seeded generators; it never
decides policy.
"""

from __future__ import annotations

import torch

from tailserve.engine.sampler import Sampler, SamplingTensors, fast_argmax
from tailserve.engine.scheduler import ModelRunnerOutput, SchedulerOutput
from tailserve.model.attention import build_attention_metadata
from tailserve.model.config import ModelArchConfig
from tailserve.model.llama import LlamaFamilyModel
from tailserve.sampling_params import SamplingParams
from tailserve.spec.rejection_sampler import RejectionSampler, greedy_rows


class ModelRunner:
    def __init__(self, model: LlamaFamilyModel, arch: ModelArchConfig, kv_caches: list[torch.Tensor],
                 block_size: int, device: torch.device, seed: int = 0) -> None:
        self.model = model
        self.arch = arch
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(arch.vocab_size, device, seed)
        self.rejection_sampler = RejectionSampler(self.sampler.generator)
        self._generators: dict[str, torch.Generator] = {}

    def generator_for(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        return self._generator(request_id, params)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None or params.greedy:
            return None
        g = self._generators.get(request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(params.seed)
            self._generators[request_id] = g
        return g

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, params: dict[str, SamplingParams],
                draft_probs: dict[str, torch.Tensor] | None = None) -> ModelRunnerOutput:
        """Run one step. Requests with draft tokens are verified: their last k+1 positions
        are sampled through the rejection sampler (``draft_probs`` None = one-hot drafts)."""
        self.forget(sched.finished_ids)
        input_ids: list[int] = []
        query_lens, context_lens, tables = [], [], []
        positions: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        spec = any(s.num_draft_tokens for s in sched.scheduled)
        num_drafts: list[int] = []
        for seq in sched.scheduled:
            n = len(seq.token_ids)
            input_ids.extend(seq.token_ids)
            positions.extend(range(seq.start_pos, seq.start_pos + n))
            query_lens.append(n)
            context_lens.append(seq.start_pos + n)
            tables.append(seq.block_ids)
            if seq.sample:
                k = seq.num_draft_tokens
                sample_rows.extend(range(len(input_ids) - 1 - k, len(input_ids)))
                sample_ids.append(seq.request_id)
                num_drafts.append(k)
        if not input_ids:
            return ModelRunnerOutput()
        meta = build_attention_metadata(query_lens, context_lens, tables, self.block_size,
                                        self.arch.sliding_window, self.device)
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(ids_t, pos_t, self.kv_caches, meta)
        if not sample_rows:
            return ModelRunnerOutput()
        if len(sample_rows) < len(input_ids):
            hidden = hidden[torch.tensor(sample_rows, device=self.device)]
        logits = self.model.compute_logits(hidden)  # (rows, V) float32
        plist = [params[rid] for rid in sample_ids]
        out = ModelRunnerOutput()
        if not spec and all(p.greedy for p in plist):
            tokens = fast_argmax(logits)  # the common all-greedy case: nothing to prepare
            emitted = [[t] for t in tokens.tolist()]
            rows_of = [[i] for i in range(len(sample_ids))]
        elif not spec:
            st = SamplingTensors.from_params(plist, self.arch.vocab_size, self.device)
            gens = [self._generator(rid, p) for rid, p in zip(sample_ids, plist)]
            tokens = self.sampler.sample(logits, st, gens)
            emitted = [[t] for t in tokens.tolist()]
            rows_of = [[i] for i in range(len(sample_ids))]
        else:
            seqs = {s.request_id: s for s in sched.scheduled}
            drafts = [seqs[rid].token_ids[len(seqs[rid].token_ids) - k:] if k else []
                      for rid, k in zip(sample_ids, num_drafts)]
            if all(p.greedy for p in plist):
                # Acceptance by argmax equality needs no sampling tensors and no draft q.
                emitted = greedy_rows(logits, num_drafts, drafts)
            else:
                st = SamplingTensors.from_params(plist, self.arch.vocab_size, self.device)
                gens = [self._generator(rid, p) for rid, p in zip(sample_ids, plist)]
                probs = None
                if draft_probs is not None:
                    probs = [draft_probs[rid][:k] if k and rid in draft_probs else None
                             for rid, k in zip(sample_ids, num_drafts)]
                emitted = self.rejection_sampler(logits, num_drafts, drafts, probs, st, gens)
            starts = [0]
            for k in num_drafts:
                starts.append(starts[-1] + k + 1)
            rows_of = [list(range(s, s + len(e))) for s, e in zip(starts, emitted)]
        for rid, toks in zip(sample_ids, emitted):
            out.sampled_token_ids[rid] = toks
        want = [p.logprobs for p in plist]
        if any(k is not None for k in want):
            for rid, k, rows, toks in zip(sample_ids, want, rows_of, emitted):
                if k is not None:
                    sel = logits[torch.tensor(rows, device=self.device)]
                    out.logprobs[rid] = Sampler.logprobs(sel, torch.tensor(toks, device=self.device), [k] * len(toks))
        return out
