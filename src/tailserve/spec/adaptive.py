"""Choosing k, the number of draft tokens, from measured acceptance and measured costs.

With per-token acceptance rate a, a round of k drafts yields E[tokens] = (1 - a^(k+1)) / (1 - a)
tokens per request. Its cost is k draft forwards plus one target forward over B*(k+1)
tokens (B decoding requests). Both costs are measured as the engine runs: each model's
forward time is fitted as alpha + beta * tokens (weighted least squares, older
observations forgotten geometrically), so when the batch grows and the target becomes
compute-bound (beta * tokens dominates), extra verified tokens stop being free and the
best k falls, down to 0 (speculation off). With a fixed --num-speculative-tokens the
controller only keeps statistics.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class LinearCostModel:
    """Online weighted least squares for seconds = alpha + beta * tokens."""

    forget: float = 0.97
    prior_weight: float = 2.0
    prior_beta_fraction: float = 1.0 / 64  # prior: 64 extra tokens cost one more alpha
    sw: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    first: tuple[float, float] | None = None

    def observe(self, tokens: float, seconds: float) -> None:
        if self.first is None:
            self.first = (tokens, seconds)
        f = self.forget
        self.sw, self.sx, self.sy = self.sw * f + 1, self.sx * f + tokens, self.sy * f + seconds
        self.sxx, self.sxy = self.sxx * f + tokens * tokens, self.sxy * f + tokens * seconds

    @property
    def ready(self) -> bool:
        return self.first is not None

    def params(self) -> tuple[float, float]:
        n0, t0 = self.first or (1.0, 1e-3)
        alpha0 = t0 / (1 + self.prior_beta_fraction * n0)
        beta0 = alpha0 * self.prior_beta_fraction
        # Prior pseudo-observations at 1 and 65 tokens on the prior line keep the fit sane
        # while all real observations share one batch size.
        w = self.prior_weight
        pts = [(1.0, alpha0 + beta0), (65.0, alpha0 + 65 * beta0)]
        sw = self.sw + w * len(pts)
        sx = self.sx + w * sum(p[0] for p in pts)
        sy = self.sy + w * sum(p[1] for p in pts)
        sxx = self.sxx + w * sum(p[0] ** 2 for p in pts)
        sxy = self.sxy + w * sum(p[0] * p[1] for p in pts)
        den = sw * sxx - sx * sx
        beta = (sw * sxy - sx * sy) / den if den > 0 else beta0
        beta = max(beta, 0.0)
        alpha = max((sy - beta * sx) / sw, 1e-6)
        return alpha, beta

    def predict(self, tokens: float) -> float:
        alpha, beta = self.params()
        return alpha + beta * tokens


def expected_tokens(a: float, k: int) -> float:
    """E[tokens per round] = (1 - a^(k+1)) / (1 - a) = 1 + a + ... + a^k."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class AdaptiveSpeculation:
    k_max: int = 6
    fixed_k: int | None = None
    explore_every: int = 24
    acceptance_prior: float = 0.6
    forget: float = 0.98
    target_cost: LinearCostModel = field(default_factory=LinearCostModel)
    draft_cost: LinearCostModel = field(default_factory=LinearCostModel)
    _accepted: float = 0.0
    _tried: float = 0.0
    _steps: int = 0
    _rng: random.Random = field(default_factory=lambda: random.Random(0))
    last_k: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Per-token acceptance a, estimated as accepted / (accepted + rejections): the
        maximum-likelihood estimate for a geometric number of accepted drafts."""
        prior = 4.0
        return (self._accepted + prior * self.acceptance_prior) / (self._tried + prior)

    def observe_round(self, accepted: int, num_drafts: int) -> None:
        """One request's verification: ``accepted`` of ``num_drafts`` drafts kept."""
        if num_drafts <= 0:
            return
        self._accepted = self._accepted * self.forget + accepted
        self._tried = self._tried * self.forget + accepted + (1 if accepted < num_drafts else 0)

    def choose_k(self, num_decoding: int) -> int:
        if self.fixed_k is not None:
            self.last_k = self.fixed_k
            return self.fixed_k
        self._steps += 1
        if num_decoding <= 0:
            return 0
        if not (self.target_cost.ready and self.draft_cost.ready):
            self.last_k = max(1, self.k_max // 2)  # bootstrap: measure both models
            return self.last_k
        if self._steps % self.explore_every == 0:
            self.last_k = self._rng.randint(0, self.k_max)  # keep the cost fits fresh
            return self.last_k
        a = self.acceptance_rate
        b = num_decoding
        best_k, best_rate = 0, b / self.target_cost.predict(b)
        for k in range(1, self.k_max + 1):
            seconds = self.target_cost.predict(b * (k + 1)) + k * self.draft_cost.predict(b)
            rate = b * expected_tokens(a, k) / seconds
            if rate > best_rate:
                best_k, best_rate = k, rate
        self.last_k = best_k
        return best_k
