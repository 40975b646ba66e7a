"""Suffix decoding (Oliaro et al., "SuffixDecoding: Extreme speculative decoding for emerging
AI applications", 2024): drafts from the longest suffix of the context found in earlier text,
the request's own (prompt and output so far) or recently finished requests'.

For a context ending ``... x1 x2 ... xm``, find the longest m (up to ``max_depth``) for which
that suffix occurred before; among all its occurrences, the token that followed most often
is the first draft, with empirical probability count / occurrences; keep following the
occurrences that continue with it. The draft stops when the product of those probabilities
falls below ``min_token_prob`` or its length reaches ``max_spec_factor`` x m (a short match
earns a short draft), or k. A request repeating earlier text drafts long; one that does not
drafts nothing. Both sources are scored (the sum of the cumulative probabilities: the draft's
expected accepted length) and the better draft wins. Drafts are proposals only: the target
verifies them with a one-hot q, so the output distribution is the target's.

The paper's suffix trees are replaced by occurrence lists over flat token arrays, walked
with NumPy: a suffix tree's node for the matched suffix is exactly the set of that suffix's
occurrences, and its children's counts are the tokens that follow them. The global cache is
one append-only array of finished requests' tokens (the end of the prompt, then the output;
-1 between requests, so no match spans two) with, per token id, the positions where it
occurs; it holds at most ``max_requests`` requests and is compacted when a quarter of it is
evicted. Why not ``arctic_inference.SuffixDecodingCache`` (vLLM's): the registry has it only
as a source package whose build needs cmake, nanobind, protobuf, grpcio-tools and torch in an
isolated build environment (a multi-GB CUDA torch download here), and it ships as a vLLM plugin.
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass

import numpy as np

from tailserve.speculative.proposer import LookupProposer

# Prompt tokens kept before each cached output: enough for a repeated request's context to
# match into its earlier output from the first step.
PROMPT_TAIL_TOKENS = 64


@dataclass(frozen=True)
class SuffixCacheFigures:
    """The global cache's size, for ``LLM.stats()`` and ``/metrics`` (plain data: it crosses
    the worker seam in ``ModelRunnerOutput``)."""

    num_requests: int
    num_tokens: int
    nbytes: int
    max_requests: int


@dataclass(frozen=True)
class SuffixConfig:
    """Plain data; EngineConfig validates the suffix_* fields it is built from."""

    max_depth: int = 24  # longest suffix matched (vLLM's suffix_decoding_max_tree_depth)
    max_spec_factor: float = 1.0  # drafts at most this times the match length
    min_token_prob: float = 0.1  # stop once the draft's cumulative probability falls below
    max_requests: int = 4096  # finished requests kept in the global cache


def _walk(tokens: np.ndarray, ends: np.ndarray, pattern: np.ndarray, k: int,
          cfg: SuffixConfig) -> tuple[list[int], float]:
    """Draft from ``tokens`` given ``ends``, the positions where ``pattern[-1]`` occurs (each
    with a successor): (drafts, score)."""
    m = 1
    while m < len(pattern) and ends.size:
        prev = ends - m
        ok = prev >= 0
        keep = ends[ok][tokens[prev[ok]] == pattern[-1 - m]]
        if not keep.size:
            break
        ends = keep
        m += 1
    if not ends.size:
        return [], 0.0
    limit = min(k, int(cfg.max_spec_factor * m))
    draft: list[int] = []
    prob, score = 1.0, 0.0
    n = len(tokens)
    while len(draft) < limit:
        ends = ends[ends + 1 < n]
        nxt = tokens[ends + 1]
        valid = nxt >= 0  # -1 separates cached requests
        if not valid.any():
            break
        values, counts = np.unique(nxt[valid], return_counts=True)
        best = int(np.argmax(counts))
        prob *= counts[best] / int(valid.sum())
        if prob < cfg.min_token_prob:
            break
        tok = int(values[best])
        draft.append(tok)
        score += prob
        ends = ends[nxt == tok] + 1
    return draft, score


class SuffixCache:
    """The global cache: finished requests' tokens and, per token id, where they occur."""

    def __init__(self, cfg: SuffixConfig) -> None:
        self.cfg = cfg
        self._tokens = array("i")
        self._where: dict[int, array] = {}
        self._spans: deque[tuple[int, int]] = deque()  # (start, end) of each cached request
        self._base = 0  # positions before this are evicted (dropped at the next compaction)
        self._num_positions = 0  # entries of the occurrence lists

    @property
    def num_requests(self) -> int:
        return len(self._spans)

    @property
    def num_tokens(self) -> int:
        return sum(e - s for s, e in self._spans)

    @property
    def nbytes(self) -> int:
        """The arrays' bytes: the token array and the occurrence lists (4 bytes a position)."""
        return 4 * (len(self._tokens) + self._num_positions)

    def figures(self) -> SuffixCacheFigures:
        return SuffixCacheFigures(self.num_requests, self.num_tokens, self.nbytes, self.cfg.max_requests)

    def add(self, tokens: list[int]) -> None:
        if self.cfg.max_requests == 0 or not tokens:
            return
        start = len(self._tokens)
        for i, t in enumerate(tokens):
            self._tokens.append(t)
            self._where.setdefault(t, array("i")).append(start + i)
        self._tokens.append(-1)
        self._num_positions += len(tokens)
        self._spans.append((start, start + len(tokens)))
        while len(self._spans) > self.cfg.max_requests:
            self._base = self._spans.popleft()[1] + 1
        if self._base * 4 > len(self._tokens):  # a quarter evicted: compact
            self._compact()

    def _compact(self) -> None:
        old, spans = self._tokens, list(self._spans)
        self._tokens, self._where, self._spans, self._base = array("i"), {}, deque(), 0
        self._num_positions = sum(e - s for s, e in spans)
        for s, e in spans:
            start = len(self._tokens)
            for i, t in enumerate(old[s:e]):
                self._tokens.append(t)
                self._where.setdefault(t, array("i")).append(start + i)
            self._tokens.append(-1)
            self._spans.append((start, start + e - s))

    def draft(self, pattern: np.ndarray, k: int) -> tuple[list[int], float]:
        where = self._where.get(int(pattern[-1]))
        if where is None or not self.num_requests:
            return [], 0.0
        ends = np.frombuffer(where, dtype=np.int32).astype(np.int64)
        ends = ends[ends >= self._base]
        tokens = np.frombuffer(self._tokens, dtype=np.int32)
        return _walk(tokens, ends, pattern, k, self.cfg)


class SuffixProposer(LookupProposer):
    """Suffix decoding: the request's own text and the global cache, the better draft."""

    def __init__(self, cfg: SuffixConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or SuffixConfig()
        self.cache = SuffixCache(self.cfg)
        self.num_global_drafts = 0  # rounds whose draft came from the global cache
        self.num_local_drafts = 0

    def propose_one(self, tokens: list[int] | np.ndarray, k: int) -> list[int]:
        if k <= 0 or len(tokens) == 0:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        pattern = arr[-self.cfg.max_depth:]
        ends = np.flatnonzero(arr[:-1] == arr[-1])  # earlier occurrences, each with a successor
        local, local_score = _walk(arr, ends, pattern, k, self.cfg) if ends.size else ([], 0.0)
        glob, glob_score = self.cache.draft(pattern, k)
        if glob_score > local_score:
            self.num_global_drafts += 1
            return glob
        if local:
            self.num_local_drafts += 1
        return local

    def observe_finished(self, request_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        """A finished request's text joins the global cache: the prompt's end, then the output."""
        self.forget(request_id)
        self.cache.add(token_ids[max(num_prompt_tokens - PROMPT_TAIL_TOKENS, 0):])

    def cache_figures(self) -> SuffixCacheFigures | None:
        return self.cache.figures()
