"""Token sampling for a batch: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Parameters are turned into tensors once per batch on the host; the sampling itself is a
few tensor ops and an all-greedy fast path. An unseeded row is drawn by inverting its cumulative
distribution at one uniform number (``sample_from_probs``): one number per row, not one per
vocabulary entry (an exponential race draws V of them, 0.44 ms for 4 x 4096 on a 2-core
CPU, more than the whole filtered softmax). On the CPU with the compiled kernels the same
inversion runs in one call (``CpuKernels.inverse_cdf``, the same tokens): 33 -> 13 us for
1 x 4096 on 2 AVX2 cores, where the seven PyTorch ops cost mostly their own overhead.

A seeded request's token at sequence position t is the winner of an exponential race,
argmax_x p(x) / E_t(x), with E_t ~ Exp(1)^V from a counter-based generator keyed by (seed, t) alone
(``SeededNoise``, ``race_noise``): exact sampling from p, and a function of the request's own seed, position
and distribution only, so its tokens depend neither on what shares its batch nor on how
they were computed. Speculative decoding uses the same race (the draft proposes the winner
under q, the target's verification keeps drafts while they equal the winner under p:
a Gumbel coupling), so a seeded request's output is the same with speculation on or off, at
any k and any batch, and a preempted request recomputes exactly what it had.

top-k / top-p keep the logits at or above each row's cut-off. On the CPU with the compiled
kernels the cut-off comes from a quickselect (kernels/cpu), not from a sort of the
whole vocabulary (PyTorch's: 1.1 ms for 4 x 4096 on the same CPU).

``filtered_probs`` is shared with the speculative-decoding rejection sampler: p and q
there are exactly the distributions sampled from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tailserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tailserve.kernels.cpu import CpuKernels

_ARGMAX_CHUNK = 128
_PLAIN_ARGMAX_MAX = 24 * 1024
_NUMPY_ARGMAX_MAX = 256 * 1024


def fast_argmax(x: torch.Tensor, host: bool = False) -> torch.Tensor:
    """argmax over the last dim of (N, V), first maximum on ties, like ``torch.argmax``.

    PyTorch's CPU argmax over a large vocabulary is slow (measured: 230 us for 16 x 32000
    fp32) while ``amax`` is vectorised (17 us), so take the max of 128-wide chunks, pick the
    first chunk holding the maximum, then the first maximum inside it. Below ~24k elements
    (a few rows of a small vocabulary) the plain argmax wins: measured 5 us vs 32 us for
    1 x 4096, 19 vs 22 for 5 x 4096, 35 vs 27 for 16 x 4096, 31 vs 20 for 1 x 32000.
    """
    n, v = x.shape
    if host and x.dtype == torch.float32 and n * v <= _NUMPY_ARGMAX_MAX and x.is_contiguous():
        # ``host``: the caller's tensors are in host memory (its device, known at load time).
        # NumPy's argmax has the same rule (first maximum, a NaN counts as the largest) and
        # none of an operator call's overhead: 1 x 4096 1.4 us against 6.8, 4 x 4096 2.0
        # against 23, 1 x 32000 2.6 against 15.5 (2 Xeon cores). Past a few hundred thousand
        # elements PyTorch's threads win (64 x 32000: 299 against 230).
        return torch.from_numpy(x.numpy().argmax(-1))
    # Correct on any device; the chunks are what win on the CPU, and cost a GPU one more
    # small kernel (no host sync), so it is not worth a per-call device branch.
    if v % _ARGMAX_CHUNK or v < 4 * _ARGMAX_CHUNK or n * v <= _PLAIN_ARGMAX_MAX:
        return x.argmax(dim=-1)
    chunks = x.view(n, v // _ARGMAX_CHUNK, _ARGMAX_CHUNK)
    best = chunks.amax(dim=-1).argmax(dim=-1)  # (N,)
    inner = chunks[torch.arange(n, device=x.device), best].argmax(dim=-1)
    return best * _ARGMAX_CHUNK + inner


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # (N, 1) 1.0 for greedy rows (unused there)
    top_k: torch.Tensor | None  # (N,) vocab size when disabled; None if no row uses top-k
    top_p: torch.Tensor | None  # (N,) ; None if no row uses top-p
    min_p: torch.Tensor | None  # (N,) ; None if no row uses min-p
    greedy: torch.Tensor  # (N,) bool
    all_greedy: bool
    any_greedy: bool = True  # some row is greedy (False: nothing to take by argmax)
    kernels: CpuKernels | None = None  # the compiled CPU kernels: top-k / top-p cut-offs by quickselect

    @classmethod
    def from_params(cls, params: list[SamplingParams], vocab_size: int, device: torch.device,
                    kernels: CpuKernels | None = None) -> SamplingTensors:
        greedy = [p.greedy for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        use_k = any(p.effective_top_k for p in params)
        use_p = any(p.top_p < 1.0 for p in params)
        use_min_p = any(p.min_p > 0.0 for p in params)
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device).unsqueeze(1),
            top_k=torch.tensor([min(p.effective_top_k or vocab_size, vocab_size) for p in params],
                               device=device) if use_k else None,
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device) if use_p else None,
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device) if use_min_p else None,
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            kernels=kernels,
        )

    def repeat_rows(self, counts: list[int]) -> SamplingTensors:
        """Row i repeated counts[i] times (for k+1 verification positions per request). One
        request's row is broadcast (views: every consumer reads rows, none writes); several are
        gathered by an index built on the host (``repeat_interleave`` with a tensor of counts
        cost ~32 us a call on 2 Xeon cores, the gathers ~7 us each, once a speculative round)."""
        if len(counts) == 1:
            c = counts[0]
            return SamplingTensors(
                temperature=self.temperature.expand(c, 1),
                top_k=None if self.top_k is None else self.top_k.expand(c),
                top_p=None if self.top_p is None else self.top_p.expand(c),
                min_p=None if self.min_p is None else self.min_p.expand(c),
                greedy=self.greedy.expand(c),
                all_greedy=self.all_greedy,
                any_greedy=self.any_greedy,
                kernels=self.kernels,
            )
        idx = torch.from_numpy(np.repeat(np.arange(len(counts)), counts)).to(self.greedy.device)
        return SamplingTensors(
            temperature=self.temperature[idx],
            top_k=None if self.top_k is None else self.top_k[idx],
            top_p=None if self.top_p is None else self.top_p[idx],
            min_p=None if self.min_p is None else self.min_p[idx],
            greedy=self.greedy[idx],
            all_greedy=self.all_greedy,
            any_greedy=self.any_greedy,
            kernels=self.kernels,
        )


class SamplingTensorsCache:
    """The last batch's SamplingTensors, reused while the same parameter objects come in the
    same order: a decode's requests keep theirs step after step, and a draft's chain steps
    share one round's. Building them is a few small tensors (~15 us a call on 2 Xeon cores,
    paid once or twice a sampled speculative round); the check is an identity test per row."""

    def __init__(self, vocab_size: int, device: torch.device, kernels: CpuKernels | None = None) -> None:
        self.vocab_size, self.device, self.kernels = vocab_size, device, kernels
        self._params: list[SamplingParams] = []
        self._st: SamplingTensors | None = None

    def get(self, params: list[SamplingParams]) -> SamplingTensors:
        last = self._params
        if self._st is not None and len(last) == len(params) and all(a is b for a, b in zip(last, params)):
            return self._st
        self._st = SamplingTensors.from_params(params, self.vocab_size, self.device, self.kernels)
        self._params = list(params)
        return self._st


def _cutoffs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """(N,) per row the smallest logit that survives top-k then top-p; -inf for a row that
    filters nothing.

    Keep the top_k largest; of those, in descending order, drop a token once the
    renormalised mass strictly before it reaches top_p (only rows with top_p < 1: a float32
    cumulative sum can reach 1.0 before the tail); the most likely token always survives.
    Tokens tied with the cut-off all survive. On the CPU with the compiled kernels, by
    quickselect (``CpuKernels.sampling_cutoffs``); elsewhere by one sort, no host sync.
    """
    n, v = logits.shape
    dev = logits.device
    top_k = st.top_k if st.top_k is not None else torch.full((n,), v, dtype=torch.long, device=dev)
    top_p = st.top_p if st.top_p is not None else torch.ones(n, device=dev)
    if st.kernels is not None and logits.dtype == torch.float32:  # kernels: the CPU's, where the plan runs them
        return st.kernels.sampling_cutoffs(logits, top_k, top_p)
    sorted_logits = logits.sort(dim=-1, descending=True).values
    drop = torch.arange(v, device=dev)[None, :] >= top_k[:, None]
    if st.top_p is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        before = probs.cumsum(-1) - probs
        drop |= (before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop[:, 0] = False
    kept = (~drop).sum(-1, keepdim=True)  # a prefix of the descending order
    cut = sorted_logits.gather(1, kept - 1).squeeze(1)
    return cut.masked_fill((top_k >= v) & (top_p >= 1.0), float("-inf"))  # rows that filter nothing


def filtered_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Softmax of logits / temperature after top-k, top-p and min-p filtering. (N, V) float32.

    Filtering order (as in vLLM): top-k, then top-p on the renormalised survivors, then
    min-p relative to the most likely token. The most likely token always survives.
    """
    logits = logits.float() / st.temperature
    if st.top_k is not None or st.top_p is not None:
        cut = _cutoffs(logits, st)
        logits = logits.masked_fill(logits < cut[:, None], float("-inf"))
    probs = logits.softmax(-1)
    if st.min_p is not None:
        threshold = st.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


_MASK64 = (1 << 64) - 1


def seeded_key(seed: int, position: int) -> int:
    """The generator seed for the token at sequence ``position`` of a request seeded with
    ``seed``: splitmix64's finaliser over both, so neighbouring positions and seeds get
    unrelated streams."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1  # 63 bits: manual_seed takes any int, keep it non-negative


_MASK32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding 32-bit values."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def race_noise(keys: list[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """(len(keys), V) float64 Exp(1) draws, E[x] = -log u[x] with u[x] = (fmix32(fmix32(x ^
    hi) + lo) + 0.5) / 2^32 (lo, hi: the key's 32-bit halves): a counter-based generator, so
    any position's noise is computed where it is needed, identically on every device."""
    k = torch.tensor(keys, dtype=torch.int64, device=device)
    lo, hi = (k & _MASK32)[:, None], ((k >> 32) & _MASK32)[:, None]
    x = torch.arange(vocab_size, dtype=torch.int64, device=device)[None, :]
    h = _fmix32((_fmix32(x ^ hi) + lo) & _MASK32)
    return -torch.log((h.double() + 0.5) * 2.0**-32)


class SeededNoise:
    """The seeded rows' exponential races: per row, argmax_x p(x) / E(x) with the noise of
    that row's key (``seeded_key``; ``race_noise``). The noise of a position is the same
    wherever and whenever it is drawn (the draft's proposal, the verification, a plain decode
    step, a recompute after preemption). On the CPU with the compiled kernels one pass per
    row that takes a logarithm only for the few tokens that could still win
    (``CpuKernels.seeded_race``, the same winners); elsewhere the formula in PyTorch."""

    def __init__(self, kernels: CpuKernels | None = None) -> None:
        self.kernels = kernels

    def race(self, probs: torch.Tensor, keys: list[int]) -> torch.Tensor:
        """(N, V) probabilities (any positive scale per row), N keys -> (N,) winners."""
        if self.kernels is not None:  # the plan's compiled CPU kernels: a CPU device, float32 probabilities
            return self.kernels.seeded_race(probs.contiguous(), keys)
        return (probs.double() / race_noise(keys, probs.shape[-1], probs.device)).argmax(dim=-1)


def row_uniforms(n: int, default: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """(n,) U[0, 1), float64, for the unseeded rows' inverse-CDF draws."""
    return torch.rand((n,), generator=default, device=device, dtype=torch.float64)


def sample_from_probs(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """(N, V) probabilities (any positive scale per row), (N,) U[0, 1) -> (N,) token ids:
    the first token whose cumulative mass exceeds u times the row's total. A token of
    probability zero is never drawn (its cumulative mass equals its predecessor's)."""
    cdf = probs.double().cumsum(-1)
    target = uniform.to(cdf.dtype)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0,
                 kernels: CpuKernels | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.kernels = kernels  # the compiled CPU kernels' cut-offs, where the execution plan runs them
        self.noise = SeededNoise(kernels)
        self.host = device.type == "cpu"  # fast_argmax's NumPy path

    def sample(self, logits: torch.Tensor, st: SamplingTensors, seeded: list[int | None]) -> torch.Tensor:
        """(N, V) logits -> (N,) token ids. ``seeded[i]``: row i's ``seeded_key`` (its request's
        seed and the position sampled), or None for an unseeded row."""
        if st.all_greedy:
            return fast_argmax(logits, self.host)
        probs = filtered_probs(logits, st)
        uniform = row_uniforms(len(seeded), self.generator, probs.device)
        if self.kernels is not None:  # the plan's compiled CPU kernels: the same tokens in one call
            sampled = self.kernels.inverse_cdf(probs.contiguous(), uniform)
        else:
            sampled = sample_from_probs(probs, uniform)
        rows = [i for i, key in enumerate(seeded) if key is not None]
        if rows:
            idx = torch.tensor(rows, device=probs.device)
            sampled[idx] = self.noise.race(probs[idx], [seeded[i] for i in rows]).to(sampled.device)  # type: ignore[misc]
        if not st.any_greedy:
            return sampled  # no argmax to take (~8 us of a sampled step's ~75 on 2 Xeon cores)
        return torch.where(st.greedy, fast_argmax(logits, self.host), sampled)

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: list[int]) -> list[dict[int, float]]:
        """Per row: the sampled token's log-probability and the k[i] most likely tokens',
        from the model's raw distribution (before temperature and filtering, as vLLM)."""
        lp = logits.float().log_softmax(-1)
        kmax = max(k)
        top_vals, top_ids = lp.topk(kmax, dim=-1) if kmax > 0 else (None, None)
        chosen = lp.gather(1, tokens[:, None]).squeeze(1).tolist()
        out = []
        for i, tok in enumerate(tokens.tolist()):
            d = {tok: chosen[i]}
            if k[i] > 0:
                for v, t in zip(top_vals[i, : k[i]].tolist(), top_ids[i, : k[i]].tolist()):
                    d.setdefault(t, v)
            out.append(d)
        return out
