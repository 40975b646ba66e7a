"""``LLM``: the offline API. Give it prompts, get finished outputs back in input order."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tailserve.config import EngineConfig
from tailserve.engine.llm_engine import LLMEngine, Prompt
from tailserve.errors import InvalidRequestError
from tailserve.outputs import RequestOutput
from tailserve.sampling_params import SamplingParams


class LLM:
    """``LLM(model=PATH)``; ``model=None`` or ``"builtin"`` uses the built-in default model.

    Keyword arguments are EngineConfig fields (dtype, device, block_size,
    kv_cache_memory_bytes, max_num_seqs, max_num_batched_tokens, enable_prefix_caching, ...).
    """

    def __init__(self, model: str | None = None, **kwargs: object) -> None:
        self.engine = LLMEngine(EngineConfig(model=model or "builtin", **kwargs))  # type: ignore[arg-type]

    def memory_snapshot(self, path: str | None = None) -> dict[str, object]:
        """The CUDA caching allocator's snapshot (needs a CUDA device); with ``path``, also
        written there as ``torch.cuda.memory._dump_snapshot`` writes it, for
        ``tailserve memory analyze``."""
        snap = self.engine.memory_snapshot()
        if path is not None:
            import pathlib

            from tailserve.memory.allocator.snapshot import snapshot_bytes

            pathlib.Path(path).write_bytes(snapshot_bytes(snap))
        return snap

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); also done at exit."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> dict[str, object]:
        """The engine's figures now: the KV cache's (``KVCacheFigures``: utilisation,
        internal fragmentation, prefix-hit rates, evictions, preemptions) and speculative
        decoding's (drafts, draft tokens, accepted tokens, acceptance rate)."""
        spec = self.engine.spec_stats
        suffix = self.engine.scheduler.suffix_cache
        ctl = self.engine.scheduler.speculation
        return {
            "kv_cache": self.engine.kv_figures().as_dict(),
            "speculative": {"num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
                            "num_accepted_tokens": spec.num_accepted_tokens,
                            "acceptance_rate": spec.num_accepted_tokens / spec.num_draft_tokens
                            if spec.num_draft_tokens else None,
                            # suffix decoding's global cache (None without one, or before a request finished)
                            "suffix_cache": dataclasses.asdict(suffix) if suffix is not None else None,
                            # LOSSY benchmark mode, when on (the outputs are not the target's)
                            "synthetic_acceptance": self.engine.config.speculative_synthetic_acceptance,
                            # what adaptive k maximises, and the steps where goodput overrode throughput's k
                            "objective": self.engine.config.speculative_objective,
                            "slo": self.engine.config.slo,
                            "goodput_overrides": ctl.num_goodput_overrides if ctl is not None else 0},
            "num_steps": self.engine.num_steps,
        }

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise InvalidRequestError(
                    f"got {len(params_list)} sampling params for {len(prompt_list)} prompts", "sampling_params")
        ids = []
        try:
            for prompt, params in zip(prompt_list, params_list):
                ids.append(self.engine.add_request(prompt, params, final_only=True))  # only finished outputs read
        except Exception:
            for rid in ids:  # all or nothing: do not leave half a batch queued
                self.engine.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in prompts):
        return [list(prompts)]  # one prompt given as token ids
    if isinstance(prompts, Sequence):
        return [p if isinstance(p, str) else list(p) for p in prompts]  # type: ignore[arg-type]
    raise InvalidRequestError(f"prompts must be a string, token ids, or a list of those; got {type(prompts).__name__}",
                              "prompt")
