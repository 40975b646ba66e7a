"""The compiled top-k / top-p cut-offs (quickselect) against the sort that defines them."""

from __future__ import annotations

import pytest
import torch

from tailserve import SamplingParams
from tailserve.kernels.cpu import kernels, unavailable_reason
from tailserve.sample.sampler import SamplingTensors, _cutoffs, filtered_probs

K = kernels()
pytestmark = pytest.mark.skipif(K is None, reason=f"no compiled CPU kernels: {unavailable_reason()}")

PARAMS = [SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=1.0, top_p=0.5),
          SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5),
          SamplingParams(temperature=1.0, top_k=300, top_p=0.9), SamplingParams(temperature=1.2, top_k=2000),
          SamplingParams(temperature=1.0, top_p=0.999), SamplingParams(temperature=0.0),
          SamplingParams(temperature=1.0, top_k=1, top_p=0.3), SamplingParams(temperature=1.0, top_p=1e-6)]


@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0, 20.0])
@pytest.mark.parametrize("v", [3000, 4096, 33])
def test_quickselect_cutoffs_equal_the_sort(scale, v):
    g = torch.Generator().manual_seed(int(scale * 100) + v)
    params = [p for p in PARAMS if (p.top_k or 0) < v] or PARAMS[:3]
    logits = torch.randn(len(params), v, generator=g) * scale
    with_k = SamplingTensors.from_params(params, v, torch.device("cpu"), kernels=K)
    plain = SamplingTensors.from_params(params, v, torch.device("cpu"))
    scaled = logits / with_k.temperature
    assert torch.equal(_cutoffs(scaled, with_k), _cutoffs(scaled, plain))
    assert torch.equal(filtered_probs(logits, with_k), filtered_probs(logits, plain))


def test_ties_and_masked_tokens():
    # Ties at the cut-off all stay; -inf logits (a logits processor's bans) never count.
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0, float("-inf")],
                           [float("-inf"), 3.0, float("-inf"), 3.0, 1.0, 1.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    for p in (SamplingParams(top_k=2), SamplingParams(top_p=0.5), SamplingParams(top_p=0.9, top_k=4),
              SamplingParams(top_p=0.3)):
        st_k = SamplingTensors.from_params([p] * 3, 6, torch.device("cpu"), kernels=K)
        st = SamplingTensors.from_params([p] * 3, 6, torch.device("cpu"))
        assert torch.equal(_cutoffs(logits, st_k), _cutoffs(logits, st)), p
    st = SamplingTensors.from_params([SamplingParams(top_k=2)] * 3, 6, torch.device("cpu"), kernels=K)
    assert _cutoffs(logits, st).tolist() == [1.0, 3.0, 0.0]  # row 0: three tokens tied at 1.0 stay


def test_an_engine_on_the_cpu_uses_the_kernel():
    from tailserve import LLM

    llm = LLM(dtype="float32")
    assert llm.engine.core.worker.runner.sampler.kernels is K
    off = LLM(dtype="float32", cpu_kernels=False)
    assert off.engine.core.worker.runner.sampler.kernels is None
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=24, seed=3)
    # The same cut-offs, so the same seeded tokens.
    with_kernel, without = (e.generate(["def f(x):"], p)[0].outputs[0].token_ids for e in (llm, off))
    assert with_kernel == without


@pytest.mark.parametrize("v", [5, 4096, 50_000])
def test_seeded_race_kernel_picks_the_formulas_winner(v):
    """The compiled race skips the logarithm for tokens that cannot win: the same winners as
    the PyTorch formula, rows with zeros (filtered tokens) included."""
    from tailserve.sample.sampler import SeededNoise, seeded_key

    g = torch.Generator().manual_seed(v)
    probs = torch.softmax(torch.randn(64, v, generator=g) * 3, -1)
    probs[::3, : v // 2] = 0.0  # top-k / top-p cut-offs leave zeros
    keys = [seeded_key(11, i) for i in range(64)]
    assert torch.equal(SeededNoise(K).race(probs, keys), SeededNoise().race(probs, keys))


def test_seeded_race_draws_from_p():
    """Over positions (keys), the winner's frequencies follow p (chi-square)."""
    from tailserve.sample.sampler import SeededNoise, seeded_key
    from test_rejection_sampler import chi2_pvalue

    p = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.04, 0.01, 0.0])
    race = SeededNoise(K).race
    winners = torch.cat([race(p.expand(500, 7), [seeded_key(3, 500 * b + i) for i in range(500)])
                         for b in range(60)])
    assert chi2_pvalue(torch.bincount(winners, minlength=7).double(), p.double()) > 1e-3


@pytest.mark.parametrize("rows", [1, 3, 4, 16])
def test_inverse_cdf_kernel_draws_the_formulas_token(rows):
    """``CpuKernels.inverse_cdf`` against ``sample_from_probs`` given the same uniforms: the same
    tokens, rows with zeros (filtered tokens), unnormalised rows and the uniforms' ends included
    (1 to 3 rows run serially, 4 or more in parallel)."""
    from tailserve.sample.sampler import sample_from_probs

    g = torch.Generator().manual_seed(rows)
    for trial in range(60):
        v = int(torch.randint(2, 5000, (1,), generator=g))
        probs = torch.softmax(torch.randn(rows, v, generator=g) * float(torch.rand(1, generator=g) * 8), -1)
        if trial % 3 == 0:
            probs[:, ::3] = 0.0
        if trial % 5 == 0:
            probs = probs * 7.5  # any positive scale per row
        u = torch.rand(rows, generator=g, dtype=torch.float64)
        if trial % 7 == 0:
            u[:] = 0.0
        if trial % 11 == 0:
            u[:] = 1.0 - 2.0**-53
        assert torch.equal(K.inverse_cdf(probs, u), sample_from_probs(probs, u)), (trial, v)


def test_unseeded_rows_are_drawn_by_the_kernel_from_p():
    """The sampler's unseeded rows through the kernel: frequencies follow p (chi-square)."""
    from tailserve.sample.sampler import Sampler
    from test_rejection_sampler import chi2_pvalue

    p = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.04, 0.01, 0.0])
    sampler = Sampler(7, torch.device("cpu"), seed=5, kernels=K)
    st = SamplingTensors.from_params([SamplingParams(temperature=1.0)] * 500, 7, torch.device("cpu"), kernels=K)
    tokens = torch.cat([sampler.sample(p.log().expand(500, 7), st, [None] * 500) for _ in range(60)])
    assert chi2_pvalue(torch.bincount(tokens, minlength=7).double(), p.double()) > 1e-3


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("one_hot", [False, True])
def test_compiled_verification_equals_the_pytorch_rules(block, one_hot):
    """``CpuKernels.verify_drafts`` against ``rejection_sample_probs`` / ``block_verify_probs``
    given the same random numbers: the same accepted counts and final tokens, ragged draft
    counts (0 included) and one-hot drafts included."""
    from tailserve.sample.rejection import block_verify_probs, rejection_sample_probs

    g = torch.Generator().manual_seed(int(block) * 2 + int(one_hot))
    for _ in range(40):
        b, v = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(2, 40, (1,), generator=g))
        nd = torch.randint(0, 5, (b,), generator=g)
        kmax = int(nd.max())
        p_rows = [torch.softmax(torch.randn(int(k) + 1, v, generator=g) * 2, -1) for k in nd]
        q_rows = [torch.softmax(torch.randn(int(k), v, generator=g) * 2, -1) for k in nd]
        ids = [torch.randint(0, v, (int(k),), generator=g).tolist() for k in nd]
        u = [torch.rand(int(k), generator=g) for k in nd]
        fu = torch.rand(b, generator=g, dtype=torch.float64)
        tp, qp = torch.zeros(b, kmax + 1, v), torch.zeros(b, kmax, v)
        idp, up = torch.zeros(b, kmax, dtype=torch.long), torch.zeros(b, kmax)
        for i, k in enumerate(nd.tolist()):
            tp[i, : k + 1], tp[i, k + 1 :] = p_rows[i], p_rows[i][-1]
            qp[i, :k], idp[i, :k], up[i, :k] = q_rows[i], torch.tensor(ids[i], dtype=torch.long), u[i]
        rule = block_verify_probs if block else rejection_sample_probs
        m, final = rule(tp, None if one_hot else qp, idp, nd, torch.zeros(b, dtype=torch.bool), tp.argmax(-1), up, fu)
        got = K.verify_drafts(torch.cat(p_rows), None if one_hot else torch.cat(q_rows), ids, nd.tolist(),
                              torch.cat(u), fu, block)
        assert got == (m.tolist(), final.tolist())


def test_top2_margin_is_the_argmax_and_the_softmax_gap():
    """A greedy draft's token and confidence in one pass: the first maximum (argmax's rule,
    ties to the first), and p(top) - p(second) of the softmax within float32 rounding; a tie
    at the top gives 0, banned (-inf) tokens weigh nothing."""
    g = torch.Generator().manual_seed(3)
    for scale in (0.1, 1.0, 5.0, 30.0):
        x = torch.randn(6, 4099, generator=g) * scale  # V not a multiple of 8: the tail counts too
        x[1, :2000] = float("-inf")
        top, margin = K.top2_margin(x)
        probs = torch.softmax(x.double(), -1).topk(2, -1).values
        assert top == x.argmax(-1).tolist()
        assert margin == pytest.approx((probs[:, 0] - probs[:, 1]).tolist(), abs=1e-6)
    tied = torch.zeros(2, 10)
    tied[0, 3] = tied[0, 5] = 1.0
    assert K.top2_margin(tied) == ([3, 0], [0.0, 0.0])


def test_top2_margin_edge_rows_follow_argmax():
    """The vector passes against argmax's rule where it is easy to get wrong: the maximum in
    the tail past the last full vector, tied in and across vectors, a row of -inf, a NaN
    (argmax counts it largest: the margin is then 0), the second value tied with the first."""
    v = 4099
    x = torch.randn(8, v, generator=torch.Generator().manual_seed(5))
    x[0, v - 1] = 40.0  # the last token, in the tail
    x[1, 17] = x[1, 4000] = 40.0  # a tie across vectors: the first
    x[2, 8] = x[2, 9] = 40.0  # a tie in one vector
    x[3] = float("-inf")
    x[4, 123] = float("nan")
    x[5, 0] = float("nan")
    x[5, 7] = float("nan")
    x[6, 4097] = 40.0
    x[6, 4098] = 39.0  # the second in the tail too
    top, margin = K.top2_margin(x)
    assert top == x.argmax(-1).tolist()
    assert margin[1] == margin[2] == 0.0 and margin[4] == margin[5] == 0.0
    probs = torch.softmax(x[6].double(), -1).topk(2).values
    assert margin[6] == pytest.approx(float(probs[0] - probs[1]), abs=1e-6)
