"""The rejection sampler alone: emitted tokens follow the target distribution (chi-square),
token-wise and block verification (Sun et al. 2025), and block verification's exact
round distribution and accepted length."""

from __future__ import annotations

import itertools

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


RULES = {"token": rs.rejection_sample_probs, "block": rs.block_verify_probs}


def _round(p: torch.Tensor, q: torch.Tensor, k: int, gen: torch.Generator, rule: str = "token"
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One verification round for N trials at positions given by p (k+1, V), q (k, V)."""
    x = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=gen) for j in range(k)], dim=1)
    m, final = RULES[rule](
        p.expand(N, k + 1, V), q.expand(N, k, V), x, torch.full((N,), k), torch.zeros(N, dtype=torch.bool),
        p.argmax(-1).expand(N, k + 1), torch.rand((N, k), generator=gen),
        torch.rand((N,), generator=gen, dtype=torch.float64))
    return x, m, final


def first_two_tokens(k: int, seed: int, rule: str = "token") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    conc = torch.full((V,), 2.0)
    d = torch.distributions.Dirichlet(conc)
    torch.manual_seed(seed)
    p = d.sample((k + 2,))  # target distribution at each absolute position
    q = d.sample((k + 1,))  # draft distribution at each absolute position
    x, m, final = _round(p[: k + 1], q[:k], k, gen, rule)
    first = torch.where(m >= 1, x[:, 0], final)
    second = torch.where(m >= 2, x[:, min(1, k - 1)], final)
    # Rows that emitted only one token continue with a second round one position later.
    x2, m2, final2 = _round(p[1:], q[1:], k, gen, rule)
    second = torch.where(m == 0, torch.where(m2 >= 1, x2[:, 0], final2), second)
    return first, second, p


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("k", [1, 2, 4])
def test_emitted_tokens_follow_target_distribution(k, rule):
    first, second, p = first_two_tokens(k, seed=k, rule=rule)
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


# -- block verification against the paper's rule, with distributions that depend on the prefix --

BV, BK = 3, 3  # vocabulary, draft length


def _tables(seed: int, one_hot_draft: bool) -> tuple[dict, dict]:
    """p and q for every prefix up to BK + 3 tokens (V = 3), Dirichlet(0.7) rows; with
    ``one_hot_draft`` q puts all its mass on one token per prefix (a lookup's draft)."""
    g = torch.Generator().manual_seed(seed)
    dirichlet = torch.distributions.Dirichlet(torch.full((BV,), 0.7))
    torch.manual_seed(seed)
    p, q = {}, {}
    for n in range(BK + 4):
        for prefix in itertools.product(range(BV), repeat=n):
            row = dirichlet.sample().double()
            p[prefix] = row / row.sum()  # sums to 1 in float64, so the sums below are exact to 1e-15
            if one_hot_draft:
                q[prefix] = torch.nn.functional.one_hot(torch.randint(BV, (1,), generator=g)[0], BV).double()
            else:
                row = dirichlet.sample().double()
                q[prefix] = row / row.sum()
    return p, q


def _round_exact(p: dict, q: dict, prefix: tuple, rule: str, broken: bool = False) -> dict[tuple, float]:
    """The exact distribution of one round's emitted tokens (accepted drafts + final), by
    enumerating the drafts: the paper's algorithm written out as a reference (``broken``:
    weights h_i = p_i, a plausible mistake)."""
    out: dict[tuple, float] = {}
    for x in itertools.product(range(BV), repeat=BK):
        pr = 1.0
        for i in range(BK):
            pr *= float(q[prefix + x[:i]][x[i]])
        ctx = [prefix + x[:i] for i in range(BK + 1)]
        if rule == "token":
            stay = 1.0
            for i in range(BK + 1):
                if i == BK:
                    for y in range(BV):
                        out[(*x, y)] = out.get((*x, y), 0.0) + pr * stay * float(p[ctx[i]][y])
                    break
                a = min(1.0, float(p[ctx[i]][x[i]] / q[ctx[i]][x[i]]))
                res = (p[ctx[i]] - q[ctx[i]]).clamp_min(0)
                res = res / res.sum() if res.sum() > 0 else p[ctx[i]]
                for y in range(BV):
                    out[(*x[:i], y)] = out.get((*x[:i], y), 0.0) + pr * stay * (1 - a) * float(res[y])
                stay *= a
            continue
        ps = [1.0]
        for i in range(BK):
            ps.append(min(1.0, ps[-1] * float(p[ctx[i]][x[i]] / q[ctx[i]][x[i]])))
        hs, dists = [1.0], []
        for i in range(BK + 1):
            if i == BK:
                dists.append(p[ctx[i]])
                hs.append(ps[i])
                continue
            res = (ps[i] * p[ctx[i]] - q[ctx[i]]).clamp_min(0)
            m = float(res.sum())
            dists.append(res / m if m > 0 else p[ctx[i]])
            if i > 0:
                hs.append(ps[i] if broken else (m / (m + 1 - ps[i]) if m + 1 - ps[i] > 0 else 1.0))
        for tau in range(BK + 1):  # tau = the last i with eta_i <= h_i
            pt = hs[tau]
            for j in range(tau + 1, BK + 1):
                pt *= 1 - hs[j]
            for y in range(BV):
                out[(*x[:tau], y)] = out.get((*x[:tau], y), 0.0) + pr * pt * float(dists[tau][y])
    return out


def _first_tokens_exact(p: dict, q: dict, n: int, rule: str, broken: bool = False,
                        prefix: tuple = ()) -> dict[tuple, float]:
    """The exact distribution of the first n tokens that rounds of ``rule`` emit."""
    if n <= 0:
        return {(): 1.0}
    out: dict[tuple, float] = {}
    for s, pr in _round_exact(p, q, prefix, rule, broken).items():
        rest = {(): 1.0} if len(s) >= n else _first_tokens_exact(p, q, n - len(s), rule, broken, prefix + s)
        for t, pr2 in rest.items():
            key = (s + t)[:n]
            out[key] = out.get(key, 0.0) + pr * pr2
    return out


@pytest.mark.parametrize("one_hot_draft", [False, True])
def test_block_verification_is_lossless_and_accepts_at_least_as_many_tokens(one_hot_draft):
    """Exactly, by enumeration: the first 4 tokens of repeated block-verification rounds
    follow the target's distribution, and a round emits at least as many tokens on average
    as token-wise verification (the paper's theorem); the broken weights are not lossless."""
    for seed in range(2):
        p, q = _tables(seed, one_hot_draft)
        target = {}
        for s in itertools.product(range(BV), repeat=4):
            pr = 1.0
            for i in range(4):
                pr *= float(p[s[:i]][s[i]])
            target[s] = pr
        got = _first_tokens_exact(p, q, 4, "block")
        assert max(abs(got.get(s, 0.0) - t) for s, t in target.items()) < 1e-12
        lengths = {rule: sum(len(s) * pr for s, pr in _round_exact(p, q, (), rule).items())
                   for rule in ("token", "block")}
        assert lengths["block"] >= lengths["token"] - 1e-12
    p, q = _tables(0, one_hot_draft)
    broken = _first_tokens_exact(p, q, 2, "block", broken=True)
    exact2 = {s: float(p[()][s[0]] * p[s[:1]][s[1]]) for s in itertools.product(range(BV), repeat=2)}
    assert max(abs(broken.get(s, 0.0) - t) for s, t in exact2.items()) > 1e-3


@pytest.mark.parametrize("one_hot_draft", [False, True])
def test_block_verify_probs_draws_the_papers_round_distribution(one_hot_draft):
    """The vectorised rule against the enumerated reference: one round from the empty prefix,
    N trials, the emitted sequences' chi-square (4-token sequences and shorter)."""
    p, q = _tables(7, one_hot_draft)
    gen = torch.Generator().manual_seed(3)

    def table(t: dict, i: int) -> torch.Tensor:  # (V^i, V): row c = prefix whose base-V digits are c
        return torch.stack([t[r] for r in itertools.product(range(BV), repeat=i)]).float()

    x = torch.zeros((N, BK), dtype=torch.long)
    codes = [torch.zeros(N, dtype=torch.long)]  # per length i, each row's prefix code
    for i in range(BK):  # draw each draft from q at its own prefix
        x[:, i] = torch.multinomial(table(q, i)[codes[i]], 1, generator=gen)[:, 0]
        codes.append(codes[i] * BV + x[:, i])
    target_probs = torch.stack([table(p, i)[codes[i]] for i in range(BK + 1)], dim=1)  # (N, K+1, V)
    draft_probs = None if one_hot_draft else torch.stack([table(q, i)[codes[i]] for i in range(BK)], dim=1)
    m, final = rs.block_verify_probs(target_probs, draft_probs, x, torch.full((N,), BK),
                                     torch.zeros(N, dtype=torch.bool), target_probs.argmax(-1),
                                     torch.rand((N, BK), generator=gen),
                                     torch.rand((N,), generator=gen, dtype=torch.float64))
    exact = _round_exact(p, q, (), "block")
    keys = sorted(exact)
    index = {s: i for i, s in enumerate(keys)}
    emitted = [index[(*tuple(r[:mm]), f)] for r, mm, f in zip(x.tolist(), m.tolist(), final.tolist())]
    counts = torch.bincount(torch.tensor(emitted), minlength=len(keys)).double()
    assert chi2_pvalue(counts, torch.tensor([exact[s] for s in keys], dtype=torch.float64)) > ALPHA
