"""Modified rejection sampling (Leviathan et al. 2023; Chen et al. 2023), vectorised.

For each request b with k_b draft tokens x_1..x_k drawn from the draft's distributions
q_1..q_k, and the target's distributions p_1..p_(k+1) at the same positions:

- accept x_j with probability min(1, p_j(x_j) / q_j(x_j)), left to right;
- at the first rejection j, emit one token from normalize(max(0, p_j - q_j)) and stop;
- if all k are accepted, emit a bonus token from p_(k+1).

The emitted tokens are then distributed exactly as sampling from p token by token. p and q
are the distributions *after* temperature / top-k / top-p / min-p (``filtered_probs``), so
the output equals plain sampling with the same parameters. Greedy requests accept by
argmax equality and emit the target's argmax. An n-gram proposer's q is one-hot
(``draft_probs=None``): the acceptance probability is p(x), the residual is p without x.

Block verification (Sun et al., "Block verification accelerates speculative decoding",
ICLR 2025; ``block_verify_probs``) judges the draft block as a whole instead of token by
token: with p_0 = 1 and p_i = min(1, p_(i-1) p_i(x_i) / q_i(x_i)), the residual weight at
position i < k is h_i = m_i / (m_i + 1 - p_i), where m_i = sum_x max(0, p_i p_(i+1)(x) -
q_(i+1)(x)) is the mass left there, and h_k = p_k. It keeps tau = the last i whose uniform
falls under h_i (0 if none), emits x_1..x_tau and one token from normalize(max(0, p_tau
p_(tau+1) - q_(tau+1))) (from p_(k+1) when tau = k). The output is still exactly the
target's distribution, and the expected number of accepted drafts is provably at least the
token-wise rule's (the paper's theorem 2): a later draft can rescue an early one that
token-wise verification would have rejected. Both rules draw k uniforms and one for the
final token per request.

Seeded requests are not verified by either rule: their tokens come from the exponential
race keyed by (seed, position) that plain sampling uses (sample/sampler.py), the draft's
proposal under q and the target's verification under p sharing each position's noise, so
their output is exactly speculation-off's (``RejectionSampler.seeded_rows``). That costs
some acceptance (measured on the built-in pair at temperature 0.8: a draft token matches
the target's race winner 66% of the time, against sum min(p, q) = 70% for the rejection
rule) and buys outputs that no k, batch or load can change.

Everything is batched over requests and positions: no Python loop over either, except the
seeded rows' accept walk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tailserve.sample.sampler import (
    SamplingTensors,
    SeededNoise,
    fast_argmax,
    filtered_probs,
    sample_from_probs,
    seeded_key,
)

if TYPE_CHECKING:
    from tailserve.kernels.cpu import CpuKernels


def acceptance_probability(px: torch.Tensor, qx: torch.Tensor) -> torch.Tensor:
    """min(1, p(x)/q(x)); q(x) > 0 because x was drawn from q."""
    return torch.clamp(px / qx.clamp_min(1e-30), max=1.0)


def rejection_sample_probs(
    target_probs: torch.Tensor,  # (B, K+1, V) p at each verified position
    draft_probs: torch.Tensor | None,  # (B, K, V) q; None = one-hot at the draft tokens
    draft_ids: torch.Tensor,  # (B, K) long, padding anywhere j >= num_drafts[b]
    num_drafts: torch.Tensor,  # (B,) long
    greedy: torch.Tensor,  # (B,) bool
    target_argmax: torch.Tensor,  # (B, K+1) long, argmax of the target's raw logits
    uniform: torch.Tensor,  # (B, K) U[0, 1)
    final_uniform: torch.Tensor,  # (B,) U[0, 1), for the final token
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (num_accepted (B,), final_token (B,)): request b emits
    draft_ids[b, :num_accepted[b]] followed by final_token[b]."""
    b, k1, _ = target_probs.shape
    k = k1 - 1
    rows = torch.arange(b, device=target_probs.device)
    valid = torch.arange(k, device=draft_ids.device)[None, :] < num_drafts[:, None]  # (B, K)
    if k > 0:
        px = target_probs[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1)  # (B, K)
        qx = torch.ones_like(px) if draft_probs is None else draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1)
        accept_random = uniform < acceptance_probability(px, qx)
        accept_greedy = draft_ids == target_argmax[:, :k]
        accept = torch.where(greedy[:, None], accept_greedy, accept_random) & valid
        num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # (B,)
    else:
        num_accepted = torch.zeros(b, dtype=torch.long, device=target_probs.device)

    p_final = target_probs[rows, num_accepted]  # (B, V)
    rejected = num_accepted < num_drafts  # stopped at a rejection (not all accepted)
    if k > 0:
        j = num_accepted.clamp(max=k - 1)
        x = draft_ids[rows, j]
        if draft_probs is None:
            residual = p_final.scatter(-1, x[:, None], 0.0)
        else:
            residual = (p_final - draft_probs[rows, j]).clamp_min(0.0)
        mass = residual.sum(-1, keepdim=True)
        # p == q exactly leaves no residual mass; then any draw from p is exact (the
        # rejection had probability zero), so fall back to p.
        residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_final)
        p_final = torch.where(rejected[:, None], residual, p_final)
    sampled = sample_from_probs(p_final, final_uniform)
    greedy_final = target_argmax[rows, num_accepted]
    final = torch.where(greedy, greedy_final, sampled)
    return num_accepted, final


def block_verify_probs(
    target_probs: torch.Tensor,  # (B, K+1, V) p at each verified position
    draft_probs: torch.Tensor | None,  # (B, K, V) q; None = one-hot at the draft tokens
    draft_ids: torch.Tensor,  # (B, K) long, padding anywhere j >= num_drafts[b]
    num_drafts: torch.Tensor,  # (B,) long
    greedy: torch.Tensor,  # (B,) bool
    target_argmax: torch.Tensor,  # (B, K+1) long, argmax of the target's raw logits
    uniform: torch.Tensor,  # (B, K) U[0, 1)
    final_uniform: torch.Tensor,  # (B,) U[0, 1), for the final token
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification (see the module docstring); the same contract as
    ``rejection_sample_probs``. Greedy rows accept by argmax equality, as there."""
    b, k1, _ = target_probs.shape
    k = k1 - 1
    if k == 0:
        return rejection_sample_probs(target_probs, draft_probs, draft_ids, num_drafts, greedy, target_argmax,
                                      uniform, final_uniform)
    device = target_probs.device
    rows = torch.arange(b, device=device)
    pos = torch.arange(k1, device=device)  # 0..K
    valid = pos[None, 1:] <= num_drafts[:, None]  # (B, K): draft j = 1..K exists
    px = target_probs[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1)  # (B, K)
    qx = torch.ones_like(px) if draft_probs is None else draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1)
    # p_i = min(1, p_(i-1) r_i) in logs is L_i = min(0, L_(i-1) + log r_i) = S_i - max(0, S_1..S_i)
    # with S the running sum of log r: a cumsum and a cummax, no loop over positions.
    log_r = torch.where(valid, torch.log(px / qx.clamp_min(1e-30)), torch.zeros_like(px))
    s = log_r.cumsum(dim=1)
    p = torch.ones((b, k1), dtype=px.dtype, device=device)
    p[:, 1:] = torch.exp(s - s.clamp_min(0.0).cummax(dim=1).values)  # (B, K+1): p_0..p_K
    # Residuals at positions 0..K-1 (after i drafts): max(0, p_i p_(i+1) - q_(i+1)).
    scaled = p[:, :k, None] * target_probs[:, :k]  # (B, K, V)
    if draft_probs is None:
        # One-hot q: p_i p(x) <= 1 leaves nothing at the draft token, the rest as it is.
        residual = scaled.scatter(-1, draft_ids[..., None], 0.0)
    else:
        residual = (scaled - draft_probs).clamp_min(0.0)
    mass = residual.sum(-1)  # (B, K)
    den = mass + 1.0 - p[:, :k]
    # h_0 = 1 (tau = 0 always qualifies); h_i for 0 < i < k_b from the mass; h_(k_b) = p_(k_b);
    # none past k_b. A zero denominator (p_i = 1, p = q there) weighs 1: stopping there is then
    # never needed and the fallback below is exact.
    h = torch.where(den > 0, mass / den.clamp_min(1e-30), torch.ones_like(mass))  # index i = position i
    h = torch.where(pos[None, :k] == num_drafts[:, None], p[:, :k], h)
    h_last = torch.where(num_drafts == k, p[:, k], torch.zeros_like(p[:, k]))
    h = torch.cat([h, h_last[:, None]], dim=1)  # (B, K+1)
    h[:, 0] = 1.0
    ok = torch.cat([torch.ones((b, 1), dtype=torch.bool, device=device), uniform < h[:, 1:]], dim=1)
    ok &= pos[None, :] <= num_drafts[:, None]
    tau = (ok.long() * pos[None, :]).amax(dim=1)  # (B,)

    stopped = tau < num_drafts
    j = tau.clamp(max=k - 1)
    res = residual[rows, j]
    res_mass = res.sum(-1, keepdim=True)
    p_next = target_probs[rows, tau]  # (B, V)
    res = torch.where(res_mass > 0, res / res_mass.clamp_min(1e-30), p_next)
    p_final = torch.where(stopped[:, None], res, p_next)
    sampled = sample_from_probs(p_final, final_uniform)

    accept_greedy = (draft_ids == target_argmax[:, :k]) & valid
    greedy_acc = accept_greedy.long().cumprod(dim=1).sum(dim=1)
    num_accepted = torch.where(greedy, greedy_acc, tau)
    final = torch.where(greedy, target_argmax[rows, greedy_acc], sampled)
    return num_accepted, final


VERIFICATION_RULES = ("token", "block")


class RejectionSampler:
    """Builds the padded tensors from a runner's flat rows, draws the random numbers and
    applies the verification rule ("token": ``rejection_sample_probs``; "block":
    ``block_verify_probs``) to the unseeded sampled rows. Seeded rows are verified by their
    exponential race instead (``seeded_rows``), greedy rows by argmax equality."""

    def __init__(self, generator: torch.Generator, noise: SeededNoise, verification: str = "token",
                 kernels: CpuKernels | None = None) -> None:
        """``kernels``: the compiled CPU kernels, where the plan runs them: the rule in one call
        (``CpuKernels.verify_drafts``) instead of a few dozen tensor operations (measured on 2
        AVX2 cores, 4 requests x 4 drafts x 4,096 tokens: ~0.7 ms a call in PyTorch)."""
        if verification not in VERIFICATION_RULES:
            raise ValueError(f"verification must be one of {VERIFICATION_RULES}, got {verification!r}")
        self.generator = generator
        self.noise = noise
        self.block = verification == "block"
        self.verify = block_verify_probs if self.block else rejection_sample_probs
        self.kernels = kernels
        self.host = generator.device.type == "cpu"  # fast_argmax's NumPy path

    def __call__(
        self,
        target_logits: torch.Tensor,  # (sum(k_b + 1), V): each request's k_b+1 rows in order
        num_drafts: list[int],
        draft_ids: list[list[int]],
        draft_probs: list[torch.Tensor] | None,  # per request (k_b, V); None = one-hot (n-gram)
        st: SamplingTensors,  # one row per request
        seeded: list[tuple[int, int] | None],  # per request (seed, position of its first verified row)
    ) -> list[list[int]]:
        if st.all_greedy:
            return greedy_rows(target_logits, num_drafts, draft_ids, self.host)
        greedy = st.greedy.tolist()
        if all(g or s is not None for g, s in zip(greedy, seeded)):
            # No row for the rule: argmax walks and races only.
            probs = filtered_probs(target_logits, st.repeat_rows([k + 1 for k in num_drafts]))
            return self.seeded_rows(target_logits, probs, num_drafts, draft_ids, seeded, greedy)
        if self.kernels is not None:  # the plan's compiled CPU kernels, so a CPU device
            return self._on_kernels(target_logits, num_drafts, draft_ids, draft_probs, st, seeded, greedy)
        device = target_logits.device
        bsz, v = len(num_drafts), target_logits.shape[-1]
        kmax = max(num_drafts)
        counts = [k + 1 for k in num_drafts]
        nd = torch.tensor(num_drafts, device=device)
        # Every request with the same number of drafts (the common case): the flat rows are
        # already (B, K+1), a view; otherwise gather them with the padding clamped.
        even = all(k == kmax for k in num_drafts)
        if even:
            def padded(x: torch.Tensor) -> torch.Tensor:
                return x.view(bsz, kmax + 1, *x.shape[1:])
        else:
            starts = torch.tensor([0, *counts[:-1]], device=device).cumsum(0)
            offs = torch.arange(kmax + 1, device=device)
            row_idx = starts[:, None] + torch.minimum(offs[None, :], nd[:, None])  # (B, K+1)

            def padded(x: torch.Tensor) -> torch.Tensor:
                return x[row_idx]
        argmax = padded(fast_argmax(target_logits, self.host))  # (B, K+1)
        ids = torch.tensor([[*d, *([0] * (kmax - len(d)))] for d in draft_ids], dtype=torch.long,
                           device=device).view(bsz, kmax)
        q = None
        if draft_probs is not None:
            if even and kmax and all(dp is not None and dp.shape[0] == kmax for dp in draft_probs):
                q = torch.stack(draft_probs)  # type: ignore[arg-type]
            else:
                q = torch.zeros((bsz, kmax, v), device=device)
                for i, dp in enumerate(draft_probs):
                    if dp is not None and dp.shape[0]:
                        q[i, : dp.shape[0]] = dp
        uniform = torch.rand((bsz, kmax), generator=self.generator, device=device)
        final_u = torch.rand((bsz,), generator=self.generator, device=device, dtype=torch.float64)
        flat_probs = filtered_probs(target_logits, st.repeat_rows(counts))  # (rows, V)
        num_acc, final = self.verify(padded(flat_probs), q, ids, nd, st.greedy, argmax, uniform, final_u)
        out = [[*d[:m], f] for d, m, f in zip(draft_ids, num_acc.tolist(), final.tolist())]
        if any(s is not None for s in seeded):
            raced = self.seeded_rows(target_logits, flat_probs, num_drafts, draft_ids, seeded, greedy)
            out = [r if s is not None else o for o, r, s in zip(out, raced, seeded)]
        return out

    def _on_kernels(self, target_logits: torch.Tensor, num_drafts: list[int], draft_ids: list[list[int]],
                    draft_probs: list[torch.Tensor] | None, st: SamplingTensors,
                    seeded: list[tuple[int, int] | None], greedy: list[bool]) -> list[list[int]]:
        assert self.kernels is not None
        v = target_logits.shape[-1]
        probs = filtered_probs(target_logits, st.repeat_rows([k + 1 for k in num_drafts]))  # (rows, V)
        q = None
        if draft_probs is not None:
            # Greedy and seeded rows carry no q (their results are replaced below): zeros.
            parts = [dp[:k] if dp is not None and dp.shape[0] >= k else torch.zeros((k, v))
                     for dp, k in zip(draft_probs, num_drafts)]
            q = parts[0] if len(parts) == 1 else torch.cat(parts)
        uniform = torch.rand((sum(num_drafts),), generator=self.generator)
        final_u = torch.rand((len(num_drafts),), generator=self.generator, dtype=torch.float64)
        acc, fin = self.kernels.verify_drafts(probs, q, draft_ids, num_drafts, uniform, final_u, self.block)
        out = [[*d[:m], f] for d, m, f in zip(draft_ids, acc, fin)]
        if any(greedy) or any(s is not None for s in seeded):
            other = self.seeded_rows(target_logits, probs, num_drafts, draft_ids, seeded, greedy)
            out = [o if g or s is not None else r for r, o, g, s in zip(out, other, greedy, seeded)]
        return out

    def seeded_rows(self, target_logits: torch.Tensor, probs: torch.Tensor, num_drafts: list[int],
                    draft_ids: list[list[int]], seeded: list[tuple[int, int] | None],
                    greedy: list[bool]) -> list[list[int]]:
        """Greedy rows by argmax equality; seeded rows by their race: at each verified row
        the winner under p with the position's noise (``SeededNoise``), drafts kept while
        they equal it, then the winner at the first difference (or the bonus row). That is
        plain sampling's token at every position, whatever the drafts: exact, and the same
        output as speculation off. (Unseeded non-greedy rows are not computed here.)"""
        out = greedy_rows(target_logits, num_drafts, draft_ids, self.host)
        keys, rows, row = [], [], 0
        for k, s in zip(num_drafts, seeded):
            if s is not None:
                keys.extend(seeded_key(s[0], s[1] + j) for j in range(k + 1))
                rows.extend(range(row, row + k + 1))
            row += k + 1
        if not rows:
            return out
        idx = torch.tensor(rows, device=probs.device)
        winners = self.noise.race(probs[idx], keys).tolist()
        at = 0
        for i, (k, s) in enumerate(zip(num_drafts, seeded)):
            if s is None or greedy[i]:
                at += (k + 1) if s is not None else 0
                continue
            w, d = winners[at : at + k + 1], draft_ids[i]
            m = 0
            while m < k and d[m] == w[m]:
                m += 1
            out[i] = [*d[:m], w[m]]
            at += k + 1
        return out


def greedy_rows(target_logits: torch.Tensor, num_drafts: list[int], draft_ids: list[list[int]],
                host: bool = False) -> list[list[int]]:
    """All-greedy batch: one argmax over every verified row, then the accept walk in Python
    (a handful of tokens; cheaper than a dozen tiny tensor ops). ``host``: see fast_argmax."""
    argmax = fast_argmax(target_logits, host).tolist()
    out, row = [], 0
    for k, drafts in zip(num_drafts, draft_ids):
        m = 0
        while m < k and drafts[m] == argmax[row + m]:
            m += 1
        out.append([*drafts[:m], argmax[row + m]])
        row += k + 1
    return out


def synthetic_rows(target_tokens: list[int], num_drafts: list[int], draft_ids: list[list[int]], acceptance: float,
                   generator: torch.Generator | None) -> list[list[int]]:
    """LOSSY, for benchmarks only (``speculative_synthetic_acceptance``, as vLLM's synthetic
    mode): each draft is accepted with probability ``acceptance`` whatever the target says,
    so the system's speed for any acceptance rate can be measured on any target/draft pair.
    ``target_tokens``: the target's own token at every verified row; the first rejected
    position (or the bonus) takes it."""
    u = torch.rand((max(sum(num_drafts), 1),), generator=generator, dtype=torch.float64).tolist()
    out, row, draw = [], 0, 0
    for k, drafts in zip(num_drafts, draft_ids):
        m = 0
        while m < k and u[draw + m] < acceptance:
            m += 1
        out.append([*drafts[:m], target_tokens[row + m]])
        row += k + 1
        draw += k
    return out
