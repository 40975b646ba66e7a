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
in one compiled call where the CPU kernels are built (``CpuKernels.suffix_walk``, step by
step), with NumPy otherwise (the same drafts, tested): a suffix tree's node for the matched
suffix is exactly the set of that suffix's occurrences, and its children's counts are the
tokens that follow them. The global cache is
one append-only array of finished requests' tokens (the end of the prompt, then the output;
-1 between requests, so no match spans two) with, per token id, the positions where it
occurs; it holds at most ``max_requests`` requests and is compacted when a quarter of it is
evicted. Why not ``arctic_inference.SuffixDecodingCache`` (vLLM's): the registry has it only
as a source package whose build needs cmake, nanobind, protobuf, grpcio-tools and torch in an
isolated build environment (a multi-GB CUDA torch download here), and it ships as a vLLM plugin.

The empirical probabilities are calibrated by what the target then accepted (``DraftCalibration``):
a one-token match in text that does not repeat (a long prompt of ids that rarely recur) finds
an occurrence or two and drafts what followed them with probability 0.5-1.0, of which the
target accepted 19 in 507 (four 7,000-token random prompts, k = 8, 2 Xeon cores: TPOT
3.11-3.30 ms against 1.91-2.06 with speculation off); each such draft is a verification row, about a layer's
attention at that context, for nothing. Per source and match length, accepted drafts over the
tokens the probabilities expected scale the probabilities before ``min_token_prob`` is
applied, so a match length whose drafts the target keeps rejecting stops drafting (there: 37
drafts, TPOT 2.21-2.30 ms against 1.94-1.97), and one whose drafts do better than their
counts say drafts longer.
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass

import numpy as np

from tailserve.speculative.proposer import LookupProposer, ProposalInput

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


# Match lengths the calibration tells apart; longer matches share the last bucket.
CALIBRATED_MATCH_LENGTHS = 8
LOCAL, GLOBAL = 0, 1  # draft sources: the request's own text, the global cache


class DraftCalibration:
    """How each (source, match length)'s drafts fared: the tokens the target accepted over the
    tokens the empirical probabilities expected (the sum of a draft's cumulative
    probabilities), as a factor on those probabilities.

    A request's next tokens say how its last draft fared whatever the sampling (with a
    one-hot q a draft token is accepted exactly when the target's token equals it), so the
    proposer needs no report from the verifier. A bucket's factor is (accepted + PRIOR x f) /
    (expected + PRIOR), where f is the factor of all buckets pooled, (accepted + PRIOR) /
    (expected + PRIOR) summed over them: a bucket without drafts yet starts where the others
    stand (the probabilities as counted, before any draft), so a text that defeats one-token
    matches does not teach each source and match length the same lesson again (on 7,000-token
    random prompts, 20-35 drafts a bucket before it held back, six buckets in use). Evidence
    decays by DECAY per observed draft in its bucket (about the last 50 count). A bucket whose
    factor holds every draft still drafts one in PROBE_EVERY, unscaled, so the factor follows
    the text when it changes."""

    PRIOR = 2.0
    DECAY = 0.98
    PROBE_EVERY = 32

    def __init__(self) -> None:
        shape = (2, CALIBRATED_MATCH_LENGTHS)
        self.accepted = np.zeros(shape)
        self.expected = np.zeros(shape)
        self.scales = np.ones(shape)  # (source, bucket) -> factor on the probabilities
        self.num_held = np.zeros(shape, dtype=np.int64)  # drafts the factor held back

    @staticmethod
    def bucket(match_len: int) -> int:
        return min(match_len, CALIBRATED_MATCH_LENGTHS) - 1

    def observe(self, source: int, bucket: int, expected: float, accepted: int) -> None:
        self.accepted[source, bucket] = self.DECAY * self.accepted[source, bucket] + accepted
        self.expected[source, bucket] = self.DECAY * self.expected[source, bucket] + expected
        pooled = (self.accepted.sum() + self.PRIOR) / (self.expected.sum() + self.PRIOR)
        self.scales = (self.accepted + self.PRIOR * pooled) / (self.expected + self.PRIOR)

    def hold(self, source: int, bucket: int) -> bool:
        """A draft the factor would hold back: True, except for one in PROBE_EVERY."""
        self.num_held[source, bucket] += 1
        return self.num_held[source, bucket] % self.PROBE_EVERY != 0


@dataclass(frozen=True)
class Draft:
    """A lookup's draft: its tokens, their cumulative empirical probabilities (unscaled), the
    length of the match it came from, its source, and its score (the calibrated expected
    accepted length)."""

    tokens: list[int]
    cum_probs: list[float]
    match_len: int
    source: int
    score: float


def _no_draft() -> Draft:
    return Draft([], [], 0, LOCAL, 0.0)  # a fresh list: the runner keeps a request's drafts


# Past this many candidate occurrences a match is extended one token at a time (each step
# filters them); at or below it, every candidate's agreement with the pattern is found in one
# comparison over the pattern's length.
_EXTEND_AT_ONCE = 64


def _extend_match(tokens: np.ndarray, ends: np.ndarray, pattern: np.ndarray) -> tuple[int, np.ndarray]:
    """The longest m <= len(pattern) for which some occurrence's m tokens ending at it equal
    the pattern's last m, and the occurrences that reach it (``ends``: where pattern[-1]
    occurs, so m >= 1)."""
    m = 1
    while m < len(pattern) and ends.size > _EXTEND_AT_ONCE:
        prev = ends - m
        ok = prev >= 0
        keep = ends[ok][tokens[prev[ok]] == pattern[-1 - m]]
        if not keep.size:
            return m, ends
        ends = keep
        m += 1
    if m >= len(pattern) or not ends.size:
        return m, ends
    # Each occurrence's agreement length at once: the tokens j = m .. len(pattern) - 1 back
    # from it against the pattern's, the first mismatch (or the text's start) ends it. On
    # repeated text the loop above ran all 24 steps, ~3 us of NumPy each, twice a proposal.
    back = np.arange(m, len(pattern))
    pos = ends[:, None] - back  # (E, L - m)
    valid = pos >= 0
    same = valid & (tokens[np.where(valid, pos, 0)] == pattern[-1 - back])
    agree = np.where(same.all(axis=1), len(back), np.argmin(same, axis=1))  # further tokens that match
    best = int(agree.max())
    return m + best, ends[agree == best]


def _admit(prob: float, scale: float, has_draft: bool, cfg: SuffixConfig, calibration: DraftCalibration | None,
           source: int, bucket: int) -> tuple[float, float] | None:
    """Whether the next draft token, at cumulative probability ``prob``, is drafted: (the
    scale from then on, its scaled probability), or None to stop. Below ``min_token_prob``
    after scaling it stops, except where only the calibration holds the draft's first token:
    one in PROBE_EVERY of those goes ahead, unscaled."""
    scaled = min(prob * scale, 1.0)
    if scaled >= cfg.min_token_prob:
        return scale, scaled
    if has_draft or calibration is None or prob < cfg.min_token_prob or calibration.hold(source, bucket):
        return None
    return 1.0, prob


def _walk(tokens: np.ndarray, ends: np.ndarray, pattern: np.ndarray, k: int,
          cfg: SuffixConfig, source: int = LOCAL, calibration: DraftCalibration | None = None) -> Draft:
    """Draft from ``tokens`` given ``ends``, the positions where ``pattern[-1]`` occurs (each
    with a successor). With a calibration, the probabilities are scaled by its factor for
    this source and match length before ``min_token_prob`` applies."""
    if not ends.size:
        return _no_draft()
    m, ends = _extend_match(tokens, ends, pattern)
    bucket = DraftCalibration.bucket(m)
    scale = 1.0 if calibration is None else float(calibration.scales[source, bucket])
    limit = min(k, int(cfg.max_spec_factor * m))
    draft: list[int] = []
    cum: list[float] = []
    prob, score = 1.0, 0.0
    n = len(tokens)
    while len(draft) < limit:
        ends = ends[ends + 1 < n]
        nxt = tokens[ends + 1]
        if nxt.size and nxt[0] >= 0 and (nxt == nxt[0]).all():
            # Every occurrence goes on the same way (repeated text: one occurrence, or the same
            # output cached several times): the draft takes their common continuation in one
            # gather, up to where they part, one of them meets a request boundary or the text
            # ends. Each such token's probability is the one reached so far (a unanimous count
            # is a factor of exactly 1), so the loop would have made the same draft, one
            # np.unique per token (~10 us each, twice a proposal).
            span = np.arange(limit - len(draft))
            cols = ends[:, None] + 1 + span  # (E, span)
            inside = cols < n
            cont = tokens[np.where(inside, cols, 0)]
            together = (inside & (cont == cont[0]) & (cont >= 0)).all(axis=0)
            run = span.size if together.all() else int(np.argmin(together))  # >= 1: column 0 agrees
            admitted = _admit(prob, scale, bool(draft), cfg, calibration, source, bucket)
            if admitted is None:
                break
            scale, scaled = admitted
            draft.extend(cont[0, :run].tolist())
            cum.extend([float(prob)] * run)
            for _ in range(run):  # summed as the loop sums (a tie between sources stays one)
                score += scaled
            ends = ends + run
            continue
        valid = nxt >= 0  # -1 separates cached requests
        if not valid.any():
            break
        values, counts = np.unique(nxt[valid], return_counts=True)
        best = int(np.argmax(counts))
        prob *= counts[best] / int(valid.sum())
        admitted = _admit(prob, scale, bool(draft), cfg, calibration, source, bucket)
        if admitted is None:
            break
        scale, scaled = admitted
        tok = int(values[best])
        draft.append(tok)
        cum.append(float(prob))
        score += scaled
        ends = ends[nxt == tok] + 1
    return Draft(draft, cum, m, source, score)


def _walk_compiled(kernels, tokens: np.ndarray, where: np.ndarray | None, base: int, pattern: np.ndarray, k: int,
                   cfg: SuffixConfig, source: int, calibration: DraftCalibration | None) -> Draft:
    """``_walk`` in the compiled kernels (``CpuKernels.suffix_walk``): the same draft, and the
    same count of the hold it consulted."""
    scales = probe = None
    if calibration is not None:
        scales = np.ascontiguousarray(calibration.scales[source])
        probe = ((calibration.num_held[source] + 1) % calibration.PROBE_EVERY == 0).astype(np.uint8)
    draft, cum, m, held, score = kernels.suffix_walk(tokens, pattern, where, base, k, cfg.max_spec_factor,
                                                     cfg.min_token_prob, scales, probe)
    if held >= 0:
        calibration.hold(source, held)  # counted as the walk consulted it (its answer was ``probe``)
    if m == 0:
        return _no_draft()
    return Draft(draft, cum, m, source, score)


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

    def draft(self, pattern: np.ndarray, k: int, calibration: DraftCalibration | None = None,
              kernels=None) -> Draft:
        where = self._where.get(int(pattern[-1]))
        if where is None or not self.num_requests:
            return _no_draft()
        if kernels is not None:
            return _walk_compiled(kernels, np.frombuffer(self._tokens, dtype=np.int32),
                                  np.frombuffer(where, dtype=np.int32), self._base, pattern.astype(np.int32), k,
                                  self.cfg, GLOBAL, calibration)
        ends = np.frombuffer(where, dtype=np.int32).astype(np.int64)
        ends = ends[ends >= self._base]
        tokens = np.frombuffer(self._tokens, dtype=np.int32)
        return _walk(tokens, ends, pattern, k, self.cfg, GLOBAL, calibration)


@dataclass(frozen=True)
class _Pending:
    """A request's last draft, until its next tokens say how it fared."""

    start: int  # the context's length when drafted: the draft's first token's position
    draft: Draft


class SuffixProposer(LookupProposer):
    """Suffix decoding: the request's own text and the global cache, the better draft, its
    probabilities calibrated by how the drafts before it fared."""

    def __init__(self, cfg: SuffixConfig | None = None, kernels=None) -> None:
        super().__init__()
        self.cfg = cfg or SuffixConfig()
        # The compiled walk (kernels.cpu ``CpuKernels.suffix_walk``: the same drafts, ~5x less
        # time a proposal) where the kernels are built; NumPy's otherwise.
        self.kernels = kernels
        self.cache = SuffixCache(self.cfg)
        self.calibration = DraftCalibration()
        self._pending: dict[str, _Pending] = {}
        self.num_global_drafts = 0  # rounds whose draft came from the global cache
        self.num_local_drafts = 0

    def best_draft(self, tokens: list[int] | np.ndarray, k: int) -> Draft:
        if k <= 0 or len(tokens) == 0:
            return _no_draft()
        arr = np.ascontiguousarray(tokens, dtype=np.int64)
        pattern = arr[-self.cfg.max_depth:]
        if self.kernels is not None:
            local = _walk_compiled(self.kernels, arr, None, 0, pattern, k, self.cfg, LOCAL, self.calibration)
        else:
            ends = np.flatnonzero(arr[:-1] == arr[-1])  # earlier occurrences, each with a successor
            local = _walk(arr, ends, pattern, k, self.cfg, LOCAL, self.calibration) if ends.size else _no_draft()
        glob = self.cache.draft(pattern, k, self.calibration, self.kernels)
        if glob.score > local.score:
            self.num_global_drafts += 1
            return glob
        if local.tokens:
            self.num_local_drafts += 1
        return local

    def propose_one(self, tokens: list[int] | np.ndarray, k: int) -> list[int]:
        return self.best_draft(tokens, k).tokens

    def propose_input(self, inp: ProposalInput) -> list[int]:
        if inp.k <= 0:
            return []
        arr = self.tokens_of(inp)
        pending = self._pending.pop(inp.request_id, None)
        if pending is not None:
            self._settle(pending, arr)
        draft = self.best_draft(arr, inp.k)
        if draft.tokens:
            if len(self._pending) >= self.MAX_TOKEN_COPIES:
                self._pending.clear()
            self._pending[inp.request_id] = _Pending(len(arr), draft)
        return draft.tokens

    def _settle(self, pending: _Pending, arr: np.ndarray) -> None:
        """Calibrate by how the pending draft fared: the tokens at its positions now."""
        d = pending.draft
        new = arr[pending.start:pending.start + len(d.tokens)]
        if not new.size:
            return  # the sequence has not moved on (or is another one): nothing to learn
        same = new == np.asarray(d.tokens[:new.size])
        accepted = int(same.size if same.all() else np.argmin(same))
        # Decided: a token that differs ends the draft's acceptance; otherwise only the
        # positions that have tokens are (the rest, not yet generated, are left out).
        decided = len(d.tokens) if accepted < new.size else new.size
        self.calibration.observe(d.source, DraftCalibration.bucket(d.match_len),
                                 sum(d.cum_probs[:decided]), accepted)

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self._pending.pop(request_id, None)

    def observe_finished(self, request_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        """A finished request's text joins the global cache: the prompt's end, then the output."""
        self.forget(request_id)
        self.cache.add(token_ids[max(num_prompt_tokens - PROMPT_TAIL_TOKENS, 0):])

    def cache_figures(self) -> SuffixCacheFigures | None:
        return self.cache.figures()
