"""The rejection sampler alone: emitted tokens follow the target distribution (chi-square)."""

from __future__ import annotations

import pytest
import torch

from tailserve.sample import rejection as rs

V = 6
N = 200_000
ALPHA = 1e-3  # significance for "matches"; a broken rule must fail far below it


def chi2_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expectation < 5 are pooled."""
    n = observed.sum()
    exp = expected_probs * n
    small = exp < 5
    obs = torch.cat([observed[~small], observed[small].sum().reshape(1)]) if small.any() else observed
    ex = torch.cat([exp[~small], exp[small].sum().reshape(1)]) if small.any() else exp
    keep = ex > 0
    stat = ((obs[keep] - ex[keep]) ** 2 / ex[keep]).sum()
    df = int(keep.sum()) - 1
    # chi2.sf(x, df) = Q(df/2, x/2), the regularised upper incomplete gamma function.
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


def _round(p: torch.Tensor, q: torch.Tensor, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor,
                                                                                     torch.Tensor]:
    """One verification round for N trials at positions given by p (k+1, V), q (k, V)."""
    x = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=gen) for j in range(k)], dim=1)
    m, final = rs.rejection_sample_probs(
        p.expand(N, k + 1, V), q.expand(N, k, V), x, torch.full((N,), k), torch.zeros(N, dtype=torch.bool),
        p.argmax(-1).expand(N, k + 1), torch.rand((N, k), generator=gen),
        torch.rand((N,), generator=gen, dtype=torch.float64))
    return x, m, final


def first_two_tokens(k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    conc = torch.full((V,), 2.0)
    d = torch.distributions.Dirichlet(conc)
    torch.manual_seed(seed)
    p = d.sample((k + 2,))  # target distribution at each absolute position
    q = d.sample((k + 1,))  # draft distribution at each absolute position
    x, m, final = _round(p[: k + 1], q[:k], k, gen)
    first = torch.where(m >= 1, x[:, 0], final)
    second = torch.where(m >= 2, x[:, min(1, k - 1)], final)
    # Rows that emitted only one token continue with a second round one position later.
    x2, m2, final2 = _round(p[1:], q[1:], k, gen)
    second = torch.where(m == 0, torch.where(m2 >= 1, x2[:, 0], final2), second)
    return first, second, p


@pytest.mark.parametrize("k", [1, 2, 4])
def test_emitted_tokens_follow_target_distribution(k):
    first, second, p = first_two_tokens(k, seed=k)
    assert chi2_pvalue(torch.bincount(first, minlength=V).double(), p[0].double()) > ALPHA
    pair = torch.bincount(first * V + second, minlength=V * V).double()
    expected = (p[0][:, None] * p[1][None, :]).reshape(-1).double()
    assert chi2_pvalue(pair, expected) > ALPHA


def test_broken_acceptance_rule_fails_the_same_test(monkeypatch):
    monkeypatch.setattr(rs, "acceptance_probability", lambda px, qx: qx)  # accept with q(x): wrong
    first, second, p = first_two_tokens(2, seed=2)
    pair = torch.bincount(first * V + second, minlength=V * V).double()
    expected = (p[0][:, None] * p[1][None, :]).reshape(-1).double()
    assert chi2_pvalue(pair, expected) < 1e-6


def test_identical_draft_is_always_accepted():
    gen = torch.Generator().manual_seed(0)
    p = torch.distributions.Dirichlet(torch.ones(V)).sample((4,))
    _, m, _ = _round(p, p[:3], 3, gen)
    assert bool((m == 3).all())


def test_greedy_rows_accept_by_argmax():
    p = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]).unsqueeze(0)  # (1, 3, 2)
    args = dict(draft_probs=None, num_drafts=torch.tensor([2]), greedy=torch.tensor([True]),
                target_argmax=p.argmax(-1), uniform=torch.zeros(1, 2), final_uniform=torch.zeros(1))
    m, final = rs.rejection_sample_probs(p, draft_ids=torch.tensor([[1, 0]]), **args)
    assert (m.item(), final.item()) == (2, 1)  # both drafts match the argmax; bonus = argmax at pos 2
    m, final = rs.rejection_sample_probs(p, draft_ids=torch.tensor([[1, 1]]), **args)
    assert (m.item(), final.item()) == (1, 0)  # second draft rejected; emit the argmax there


def test_greedy_rows_walk_each_request_to_its_first_mismatch():
    # Three requests with 2, 0 and 3 drafts: rows 0-2, 3, 4-7 of the flat logits.
    argmax = [5, 6, 7, 8, 1, 2, 3, 4]
    logits = torch.nn.functional.one_hot(torch.tensor(argmax), 10).float()
    out = rs.greedy_rows(logits, [2, 0, 3], [[5, 9], [], [1, 2, 3]])
    assert out == [[5, 6], [8], [1, 2, 3, 4]]  # mismatch at the 2nd draft; no drafts; all accepted + bonus
