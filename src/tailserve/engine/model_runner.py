"""Turns a ``SchedulerOutput`` into one forward pass and sampled tokens.

All scheduled work of a step (prefill chunks and decodes) is one flat batch of tokens. The
runner builds the inputs and attention metadata, runs the model, computes logits only at
the positions that sample, and samples. It keeps per-request seeded generators; it never
decides policy.
"""

from __future__ import annotations

import torch

from tailserve.engine.sampler import Sampler, SamplingTensors
from tailserve.engine.scheduler import ModelRunnerOutput, SchedulerOutput
from tailserve.model.attention import build_attention_metadata
from tailserve.model.config import ModelArchConfig
from tailserve.model.llama import LlamaFamilyModel
from tailserve.sampling_params import SamplingParams


class ModelRunner:
    def __init__(self, model: LlamaFamilyModel, arch: ModelArchConfig, kv_caches: list[torch.Tensor],
                 block_size: int, device: torch.device, seed: int = 0) -> None:
        self.model = model
        self.arch = arch
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(arch.vocab_size, device, seed)
        self._generators: dict[str, torch.Generator] = {}

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
    def execute(self, sched: SchedulerOutput, params: dict[str, SamplingParams]) -> ModelRunnerOutput:
        self.forget(sched.finished_ids)
        input_ids: list[int] = []
        query_lens, context_lens, tables = [], [], []
        positions: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        for seq in sched.scheduled:
            n = len(seq.token_ids)
            input_ids.extend(seq.token_ids)
            positions.extend(range(seq.start_pos, seq.start_pos + n))
            query_lens.append(n)
            context_lens.append(seq.start_pos + n)
            tables.append(seq.block_ids)
            if seq.sample:
                sample_rows.append(len(input_ids) - 1)
                sample_ids.append(seq.request_id)
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
        logits = self.model.compute_logits(hidden)  # (N, V) float32
        plist = [params[rid] for rid in sample_ids]
        st = SamplingTensors.from_params(plist, self.arch.vocab_size, self.device)
        gens = [self._generator(rid, p) for rid, p in zip(sample_ids, plist)]
        tokens = self.sampler.sample(logits, st, gens)
        out = ModelRunnerOutput()
        token_list = tokens.tolist()
        for rid, tok in zip(sample_ids, token_list):
            out.sampled_token_ids[rid] = [tok]
        want = [p.logprobs for p in plist]
        if any(k is not None for k in want):
            lps = Sampler.logprobs(logits, tokens, [k or 0 for k in want])
            for rid, k, lp in zip(sample_ids, want, lps):
                if k is not None:
                    out.logprobs[rid] = [lp]
        return out
