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

Everything is batched over requests and positions: no Python loop over either, except to
draw seeded requests' random numbers from their own generators.
"""

from __future__ import annotations

import torch

from tailserve.sample.sampler import SamplingTensors, fast_argmax, filtered_probs, sample_from_probs


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


class RejectionSampler:
    """Builds the padded tensors from a runner's flat rows and draws the random numbers."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(
        self,
        target_logits: torch.Tensor,  # (sum(k_b + 1), V): each request's k_b+1 rows in order
        num_drafts: list[int],
        draft_ids: list[list[int]],
        draft_probs: list[torch.Tensor] | None,  # per request (k_b, V); None = one-hot (n-gram)
        st: SamplingTensors,  # one row per request
        generators: list[torch.Generator | None],
    ) -> list[list[int]]:
        if st.all_greedy:
            return greedy_rows(target_logits, num_drafts, draft_ids)
        device = target_logits.device
        bsz, v = len(num_drafts), target_logits.shape[-1]
        kmax = max(num_drafts)
        counts = [k + 1 for k in num_drafts]
        starts = torch.tensor([0, *counts[:-1]], device=device).cumsum(0)
        offs = torch.arange(kmax + 1, device=device)
        nd = torch.tensor(num_drafts, device=device)
        row_idx = starts[:, None] + torch.minimum(offs[None, :], nd[:, None])  # (B, K+1), clamped padding
        argmax = fast_argmax(target_logits)[row_idx]  # (B, K+1)
        ids = torch.zeros((bsz, kmax), dtype=torch.long, device=device)
        for i, d in enumerate(draft_ids):
            if d:
                ids[i, : len(d)] = torch.tensor(d, dtype=torch.long, device=device)
        q = None
        if draft_probs is not None:
            q = torch.zeros((bsz, kmax, v), device=device)
            for i, dp in enumerate(draft_probs):
                if dp is not None and dp.shape[0]:
                    q[i, : dp.shape[0]] = dp
        uniform = torch.rand((bsz, kmax), generator=self.generator, device=device)
        final_u = torch.rand((bsz,), generator=self.generator, device=device, dtype=torch.float64)
        for i, g in enumerate(generators):
            if g is not None:
                # Exactly this request's k + 1 uniforms, not the batch's maximum: what a seeded
                # request draws must not depend on what shares its batch.
                if num_drafts[i]:
                    uniform[i, : num_drafts[i]] = torch.rand((num_drafts[i],), generator=g, device=device)
                final_u[i] = torch.rand((1,), generator=g, device=device, dtype=torch.float64)[0]
        target_probs = filtered_probs(target_logits, st.repeat_rows(counts))[row_idx]  # (B, K+1, V)
        num_acc, final = rejection_sample_probs(target_probs, q, ids, nd, st.greedy, argmax, uniform, final_u)
        out = []
        for i, (m, f) in enumerate(zip(num_acc.tolist(), final.tolist())):
            out.append([*draft_ids[i][:m], f])
        return out


def greedy_rows(target_logits: torch.Tensor, num_drafts: list[int], draft_ids: list[list[int]]) -> list[list[int]]:
    """All-greedy batch: one argmax over every verified row, then the accept walk in Python
    (a handful of tokens; cheaper than a dozen tiny tensor ops)."""
    argmax = fast_argmax(target_logits).tolist()
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
