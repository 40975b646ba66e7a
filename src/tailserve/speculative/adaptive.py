"""Choosing k, the number of draft tokens, from measured acceptance and measured costs.

k is a cap: a round drafts at most k tokens per request, fewer where the draft chain stops
early on an unsure draft (see ``DraftModelProposer``). What a cap buys is estimated per
draft position j from the verified rounds (geometric forgetting per engine step, so a
batch's rounds weigh alike and the memory is as many steps at any batch size; all positions
forgotten together so they describe the same recent window):

- ``go[j]``: of the rounds whose verification reached draft j (drafts 1..j-1 accepted) and
  whose cap allowed a draft j+1, the share that accepted draft j *and* had drafted j+1;
- ``acc[j]``: of the rounds that reached draft j, the share that accepted it;
- ``more[j]``: of the rounds that drafted j under a cap above j, the share that drafted j+1.

Under cap k a round then yields E[tokens] = 1 + sum_j P(reach j) * acc[j], with
P(reach j+1) = P(reach j) * go[j], and drafts sum_j P(draft j exists), the product of
more[i] for i < j. Positions without enough rounds behind them use the figures pooled over
all positions. Without early stops (more = 1) this is the geometric model: with per-token
acceptance a, E[tokens] = (1 - a^(k+1)) / (1 - a).

A round's cost is its draft forwards plus one target forward over B * (1 + drafts) tokens
(B decoding requests) plus the step's other work (scheduling, bookkeeping, detokenizing),
which a plain decode step pays too. These are measured as the engine runs: each model's
forward time is fitted as alpha + beta * tokens (weighted least squares, older observations
forgotten geometrically), the other work as a forgotten average. When the batch grows and
the target becomes compute-bound (beta * tokens dominates), extra verified tokens stop
being free and the best k falls, down to 0 (speculation off). With a fixed
--num-speculative-tokens the controller only keeps statistics.

The model can still be wrong where costs are not linear (a compiled kernel that takes up to
16 rows, a batch that spills to a slower path) or are not in it (the rejection sampler, the
draft's bookkeeping). So the controller also measures what each k delivered: tokens emitted
per second of whole step, per batch-size bucket (1, 2, 3-4, 5-8, ...; all-greedy batches
apart), from decode steps whose k equals the previous step's (a step verifies the previous
step's drafts and proposes its own), over the last ``rate_window`` such steps, as total
tokens over total seconds without the steps that took more than five times the median (a
descheduled process: on a shared 2-core machine a plain running average of per-step rates
let one slow step decide). Two sources of noise are taken out: each verified round counts
its accepted drafts at the acceptance figures' expectation (a few steps measure what a k
costs; what it yields comes from every round), and steps that admit a request stay out of
the windows, what a k > 0 adds to them charged to its rate at the bucket's admissions per
token. The cost model's choice is calibrated by the measured rates, and a bucket's
decision holds for ``decide_every`` steps (deciding costs ~120 us of Python).

Measured beats modelled: in a bucket where off or the candidate k has no measurement yet,
the controller measures it first (off first: a cold start never speculates on the model's
word alone), then speculates with the best measured k only while it beats off by
``switch_margin``.
Switching on takes ``switch_on_margin``, and off measured again after the candidate and
beaten by the candidate's newest stretch alone: every switch on costs the draft a catch-up
over the tokens generated meanwhile, which no steady step measures, and two windows taken
minutes apart compare the machine's drift (±10-25% here), not k. Explorations last
``explore_len`` steps. While speculating they take turns: off, then another k (the model's
choice, or where that is the k in use a random one at most one above the model's best), so
off every other time, since an off probe costs little exactly where speculation's lead is
thin. While off they probe the k that the start-up profile's bound (below) finds best where
it has not been measured yet, then the cheaper ones not measured yet, else the best measured k
(k = 1 where none is), the one the next decision weighs against off. Each exploration's cost
(its seconds beyond what the k in use would have taken for its tokens) sets the least number
of steps before the bucket's next, so that explorations cost at most ``explore_budget`` of its
time (a bucket's first with a draft model, not measured yet, is costed from the start-up
profile and waits until it fits that budget of the bucket's horizon: see ``_drafted``); while
they keep confirming speculation off in a bucket, the backed-off interval doubles each time (down
to 1 in ``max_backoff`` x explore_every steps; where the budget spaces them further, that
decides until the doubling passes it), and while they keep confirming it on, down to 1
in ``max_on_backoff`` x explore_every. A batch that shrinks (its requests finishing apart)
keeps the k of the bucket it shrank from for ``drain_inherit_steps`` steps.
Measured on the built-in pair (docs/benchmarks.md): without the measured check, batch 16
greedy ran at 0.73x of speculation off on a 2-core AVX2 CPU; with the running average of
per-step rates, batch 16
at temperature 0.8 ran at 0.82x on an AVX-512 one."""

from __future__ import annotations

import bisect
import random
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tailserve.config import SloBounds


def geometric_tokens(a: float, k: int) -> float:
    """Tokens a round of k drafts emits a request at per-token acceptance a (Leviathan et
    al.): (1 - a^(k+1)) / (1 - a), k + 1 at a = 1."""
    return k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


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
    _fit: tuple[float, float] | None = None  # params(), until the next observation

    def observe(self, tokens: float, seconds: float) -> None:
        self._fit = None
        if self.first is None:
            self.first = (tokens, seconds)
        f = self.forget
        self.sw, self.sx, self.sy = self.sw * f + 1, self.sx * f + tokens, self.sy * f + seconds
        self.sxx, self.sxy = self.sxx * f + tokens * tokens, self.sxy * f + tokens * seconds

    @property
    def ready(self) -> bool:
        return self.first is not None

    def params(self) -> tuple[float, float]:
        if self._fit is None:
            self._fit = self._params()
        return self._fit

    def _params(self) -> tuple[float, float]:
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


@dataclass(frozen=True)
class VerifyCostProfile:
    """What a step costs as verification widens it, measured once at start-up (the worker's
    ``ModelRunner.profile_verification``): the target's forward, logits and argmax for ``b``
    sequences of ``1 + k`` rows each, and the proposer's round of ``k`` drafts for ``b``
    requests (0 for lookups, which cost next to nothing). The controller reads it for one
    bound: what speculation could give at a batch size at a given acceptance."""

    target_s: tuple[tuple[int, int, float], ...]  # (b, k, seconds), greedy requests
    draft_s: tuple[tuple[int, int, float], ...] = ()  # (b, k, seconds); absent: drafting costs nothing
    # The same for sampled requests (the sampler or rejection sampler, the draft's q); empty:
    # as greedy.
    sampled_target_s: tuple[tuple[int, int, float], ...] = ()
    sampled_draft_s: tuple[tuple[int, int, float], ...] = ()
    # The proposer's catch-up over a request's context it has not seen, per token (a draft
    # model's prefill of a prompt at batch 1; 0 for lookups): what a draft model pays the
    # first time it runs beside a request, measured with the rest.
    catch_up_s_per_token: float = 0.0

    def step_extra_s(self, num_seqs: int, k: int, forward_s: float, greedy: bool = True) -> float | None:
        """What a step with ``k`` drafts at ``num_seqs`` decoding requests adds to an off step,
        by the profile (the wider forward and the round of drafts, no draft counted as
        accepted), scaled as in ``best_k``; a k past the profiled ones as the largest profiled
        (a lower bound); None where ``num_seqs`` was not profiled."""
        costs = self._costs(num_seqs, greedy)
        if costs is None:
            return None
        target, draft = costs
        k = max(kk for kk in target if kk <= k)
        return max(target[k] + draft.get(k, 0.0) - target[0], 0.0) * forward_s / target[0]

    def first_exploration_s(self, num_seqs: int, k: int, forward_s: float, greedy: bool, steps: int,
                            unseen_tokens: int, accepted_s: float = 0.0) -> float | None:
        """What a first exploration of ``k`` (``steps`` steps) costs beyond off, by the profile:
        the steps' extra (``step_extra_s``) less ``accepted_s`` a step (what the drafts it is
        expected to accept save: 0 where no acceptance is known), never below 0, and the
        proposer's catch-up over ``unseen_tokens`` it has never seen, scaled as in ``best_k``."""
        costs = self._costs(num_seqs, greedy)
        extra = self.step_extra_s(num_seqs, k, forward_s, greedy)
        if costs is None or extra is None:
            return None
        catch_up_s = self.catch_up_s_per_token * unseen_tokens * forward_s / costs[0][0]
        return steps * max(extra - accepted_s, 0.0) + catch_up_s

    def _costs(self, num_seqs: int, greedy: bool) -> tuple[dict[int, float], dict[int, float]] | None:
        """(k -> target seconds, k -> draft seconds) at ``num_seqs``, for a greedy or a sampled
        batch (sampled: as greedy where not profiled apart); None where not profiled."""
        sampled = not greedy and self.sampled_target_s
        target = {k: s for b, k, s in (self.sampled_target_s if sampled else self.target_s) if b == num_seqs}
        if 0 not in target:
            return None
        return target, {k: s for b, k, s in (self.sampled_draft_s if sampled else self.draft_s) if b == num_seqs}

    def best_k(self, num_seqs: int, off_step_s: float, forward_s: float, acceptance: float = 1.0,
               greedy: bool = True, measured: dict[int, float] | None = None) -> tuple[int, float] | None:
        """(k, its speed-up over off) for the profiled k that would emit the most tokens/s,
        (0, 1.0) where none beats off; None where ``num_seqs`` was not profiled.

        A round of k drafts emits (1 - a^(k+1)) / (1 - a) tokens a request (Leviathan et al.);
        its step is the off step with the forward replaced by the profiled forward at 1 + k
        rows a request plus the profiled round of k drafts, both scaled by the running
        engine's forward over the profiled one (the machine now against the machine at
        start-up). ``greedy``: the costs of a batch of greedy requests, else of sampled ones.

        ``measured`` (k -> seconds of a step with k drafts in the running engine): a measured
        k costs what it measured, and the others what the profile says plus what the measured
        steps took besides their profiled parts (their residual): interpolated between the
        measured k on either side, as the nearest one's below the smallest, and past the
        largest growing as it grew between the two largest (never shrinking). A step with
        drafts costs more than its forward and proposal, and more so the more drafts: on 2
        AMD EPYC cores (AVX2), built-in pair, batch 1 sampled, fixed k = 1, 2, 3, 4, 6 took
        2.0, 2.5, 2.8, 3.3, 4.4 off steps where the profile put them at 1.8, 2.1, 2.4, 2.9,
        4.0 (the drafts' bookkeeping, a second token's output processing, the target's
        weights evicted by the draft's forward). With only k = 1 measured, its residual
        carried unchanged to k = 4-5 kept the bound at 1.10-1.16x at the measured acceptance
        (~0.75), where no fixed k reached off (0.73-0.90x)."""
        costs = self._costs(num_seqs, greedy)
        if costs is None:
            return None
        target, draft = costs
        scale = forward_s / target[0]
        profiled = {k: (target[k] + draft.get(k, 0.0)) * scale for k in target}
        # What each measured step took besides its profiled forward and drafts, never below 0
        # (a step holds at least those). Where the profile put a measured k dearer than it ran
        # (a slow profiled round), a negative residual made other k's steps cost nothing or
        # less and the bound read 3.5-4.6 million in two of five warm batch-1 sampled runs.
        steps = measured or {}
        residual = {k: max(s - profiled[k], 0.0) for k, s in steps.items() if k > 0 and k in target}
        known = sorted(residual)
        base_s = off_step_s - forward_s  # with nothing measured: what an off step has besides its forward
        slope = 0.0
        if len(known) >= 2:
            k1, k2 = known[-2], known[-1]
            slope = max((residual[k2] - residual[k1]) / (k2 - k1), 0.0)
        a = min(max(acceptance, 0.0), 1.0)
        best_k, best = 0, 1.0
        for k in sorted(target):
            if k <= 0:
                continue
            if k in residual:
                on_s = steps[k]
            elif known:
                i = bisect.bisect_left(known, k)  # known[i - 1] < k < known[i]
                if i == 0:
                    r = residual[known[0]]
                elif i == len(known):
                    r = residual[known[-1]] + slope * (k - known[-1])
                else:
                    m1, m2 = known[i - 1], known[i]
                    r = residual[m1] + (residual[m2] - residual[m1]) * (k - m1) / (m2 - m1)
                on_s = r + profiled[k]
            else:
                on_s = base_s + profiled[k]
            tokens = geometric_tokens(a, k)
            speed_up = tokens * off_step_s / max(on_s, 1e-9)
            if speed_up > best:
                best_k, best = k, speed_up
        return best_k, best


@dataclass(frozen=True)
class BatchOutlook:
    """What the scheduler knows of a step's decoding requests and no measurement can: the
    most tokens any of them may still generate (by max_tokens and the context limit; a stop
    may end it sooner) and the tokens of their contexts that a draft model has not seen
    (what it must catch up on before it drafts for them)."""

    remaining_tokens: int
    unseen_tokens: int
    num_waiting: int = 0  # requests queued for a slot: the batch does not end with these


@dataclass
class _Share:
    """A forgotten-weighted share: hits / trials, in the controller's current units."""

    hits: float = 0.0
    trials: float = 0.0

    def add(self, hit: bool, weight: float) -> None:
        self.trials += weight
        if hit:
            self.hits += weight


@dataclass
class _RateWindow:
    """One (batch bucket, k)'s last steady steps: per step the tokens emitted, the seconds,
    and the verified rounds in it with their accepted drafts (see ``per_step``)."""

    size: int = 32
    steps: deque = field(default_factory=deque)  # (tokens, seconds, rounds, accepted)
    _kept: tuple[float, float, float, float, int] | None = None  # sums over the kept steps, until the next add
    last_step: int = -1  # the controller's step count when the newest step came in
    run: int = 0  # how many of the newest steps came in consecutively (one stretch of this k)

    def add(self, tokens: int, seconds: float, step: int = -1, rounds: int = 0, accepted: int = 0,
            gap: int = 1) -> None:
        """One step, at the controller's step count ``step``; ``gap``: the most steps since
        the last one that still make it the same stretch (quiet steps of the same k came
        between them unreported)."""
        self.run = self.run + 1 if step <= self.last_step + gap else 1
        self.last_step = step
        self.steps.append((tokens, seconds, rounds, accepted))
        if len(self.steps) > self.size:
            self.steps.popleft()
        self._kept = None

    @staticmethod
    def _sums(steps: list) -> tuple[float, float, float, float, int]:
        """Sums of (tokens, seconds, rounds, accepted) over ``steps`` without those slower
        than five times the median step (a descheduled process measures the machine, not k).
        Slow steps that k itself causes stay in: the draft's prefill of a newly admitted
        prompt, a collection of the objects speculation allocates."""
        # In C where it can be (sorted, zip, sum): a decision reads every window of its bucket.
        secs = sorted([s[1] for s in steps])
        n = len(secs)
        limit = 5.0 * (secs[n // 2] if n % 2 else (secs[n // 2 - 1] + secs[n // 2]) / 2)
        kept = steps if secs[-1] <= limit else [s for s in steps if s[1] <= limit]
        tokens, seconds, rounds, accepted = map(sum, zip(*kept))
        return tokens, seconds, rounds, accepted, len(kept)

    @staticmethod
    def _tokens(sums: tuple[float, float, float, float, int], accepted_per_round: float | None) -> float:
        """Tokens of the kept steps, each round's accepted drafts replaced by their expectation
        when given: how many a round accepts varies from 0 to k (at k = 8 and 85% acceptance
        a three-step mean of the tokens is +-30%), while the seconds a step of k takes hardly
        do, and the acceptance figures behind the expectation pool every round verified. So a
        few steps of a k measure its cost, and its yield comes from all rounds."""
        tokens, _, rounds, accepted, _ = sums
        return tokens if accepted_per_round is None else tokens - accepted + rounds * accepted_per_round

    def rate(self, accepted_per_round: float | None = None) -> float:
        """Tokens per second over the window (see ``_sums`` and ``_tokens``)."""
        tokens, seconds = self.per_step(accepted_per_round)
        return tokens / seconds

    def last_run_rate(self, accepted_per_round: float | None = None) -> float:
        """``rate`` over the newest consecutive stretch only (what the machine gave this k
        lately, for comparing two stretches run one after the other)."""
        sums = self._sums(list(self.steps)[-min(self.run, len(self.steps)):])
        return self._tokens(sums, accepted_per_round) / sums[1]

    def per_step(self, accepted_per_round: float | None = None) -> tuple[float, float]:
        """(tokens, seconds) of a mean step, over the same steps as ``rate`` (the kept steps'
        sums are kept until the next step: a choice reads several windows several times)."""
        if self._kept is None:
            self._kept = self._sums(list(self.steps))
        n = self._kept[4]
        return self._tokens(self._kept, accepted_per_round) / n, self._kept[1] / n


@dataclass
class _Admissions:
    """A batch bucket's admissions: how many per token emitted, and what a step that admits a
    request costs with k > 0 beyond one with k = 0 (the draft's prefill of the prompt, the
    verify rows beside the prompt's chunk): over the last few such steps, each k > 0 step's
    seconds beyond what an off step of as many computed tokens takes (a line through the off
    steps, tokens -> seconds: the median of their pairwise slopes and the median intercept),
    the median of those; until both sides have some, the proposal's own seconds in the k > 0
    ones (the draft's prefill). Medians, since the draft's first prefill ever (kernels built,
    buffers sized) took several times the later ones and, averaged in, kept a cold batch-1
    run off for 230 steps. Sizes, since admissions differ by more than what k adds: with
    prefix caching a repeated prompt computes a few tokens, a new one all of them, and the
    plain difference of medians charged k 7.9 ms an admission (its steps from a first pass of
    new prompts, off's from a second of cached ones) where the draft's prefill took 0.8-2 ms,
    and kept a batch-1 bucket off where k = 2 ran 1.13x (built-in pair, t = 0.8, Xeon)."""

    tokens: float = 0.0
    admissions: float = 0.0
    propose_s: deque = field(default_factory=lambda: deque(maxlen=15))
    on_s: deque = field(default_factory=lambda: deque(maxlen=15))  # (computed tokens, seconds)
    off_s: deque = field(default_factory=lambda: deque(maxlen=15))
    _extra: float | None = None  # extra_s(), until the next admission

    def observe(self, num_tokens: int, admits: bool, k: int, seconds: float, propose_s: float,
                computed_tokens: int = 0) -> None:
        if self.tokens > 1e5:  # the workload's recent mix: older halves fade
            self.tokens, self.admissions = self.tokens / 2, self.admissions / 2
        self.tokens += num_tokens
        if admits:
            self.admissions += 1
            self._extra = None
            if k > 0:
                self.propose_s.append(propose_s)
                self.on_s.append((computed_tokens, seconds))
            else:
                self.off_s.append((computed_tokens, seconds))

    def extra_s(self) -> float | None:
        """Seconds a k > 0 adds to an admission step (None: no such step seen)."""
        if not self.propose_s:
            return None
        if self._extra is None:
            self._extra = self._extra_s()
        return self._extra

    def _extra_s(self) -> float:
        if len(self.on_s) < 3 or len(self.off_s) < 3:
            return statistics.median(self.propose_s)
        off = list(self.off_s)
        slopes = [(s2 - s1) / (n2 - n1) for i, (n1, s1) in enumerate(off) for n2, s2 in off[i + 1:] if n2 != n1]
        slope = max(statistics.median(slopes), 0.0) if slopes else 0.0
        base = statistics.median(s - slope * n for n, s in off)
        return max(statistics.median(s - (base + slope * n) for n, s in self.on_s), 0.0)


@dataclass(slots=True)
class _Lease:
    """Quiet steps granted after a quiet one (``AdaptiveSpeculation._lease``): for this batch
    size and class, ``left`` more may be taken; ``taken`` is counted at the next settle."""

    num_decoding: int
    greedy: bool
    bucket: int | None  # None: no k fits the rows
    left: int
    held: bool  # a held decision's: its steps count toward the bucket's next exploration
    taken: int = 0


@dataclass(frozen=True)
class SloState:
    """What the goodput objective weighs in one step (built by the scheduler): per decoding
    request, the seconds since its first token and the tokens after it (its TPOT so far is
    their ratio); per request still without a first token, the seconds since it arrived, in
    the order they will be served (the ``num_prefilling`` in this step's prefill first, then
    the queue). Where the batch is full a queued request waits for a decoding request to
    finish: ``free_slots`` is how many the batch may still admit (None: no limit), and
    ``decode_remaining_tokens`` the most tokens each decoding request may still generate,
    ascending (stops may end one sooner). A request preempted after its first token waits in
    the queue too, but its TTFT is decided: ``waiting_decoded`` gives, per entry of
    ``waiting_ages_s`` (empty: none has one), None or such a request's seconds since its
    first token and tokens after it, and it is judged by its TPOT, the wait added to its
    seconds with no tokens."""

    decode_elapsed_s: tuple[float, ...] = ()
    decode_tokens: tuple[int, ...] = ()
    waiting_ages_s: tuple[float, ...] = ()
    num_prefilling: int = 0
    free_slots: int | None = None
    decode_remaining_tokens: tuple[int, ...] = ()
    waiting_decoded: tuple[tuple[float, int] | None, ...] = ()


@dataclass
class AdaptiveSpeculation:
    k_max: int = 8
    fixed_k: int | None = None
    # The most rows (decoding requests x (1 + k)) a verification step may take (the plan's
    # max_verify_rows; None: no limit): k <= max_rows // b - 1 at b decoding requests.
    max_rows: int | None = None
    # The proposer looks drafts up in text (n-gram, suffix): nothing to catch up on, so it may
    # draft nothing for a step at no later cost. It then drafts nothing where the next step
    # will carry prompt tokens (the scheduler's ``_prompt_next``): there verification rows sit
    # beside a prompt's chunk, at long contexts each about a layer's attention, and delay that
    # prompt's first token. On the bench's agentic sessions (4 at once, ~7,000-token contexts,
    # 2 Xeon cores) suffix decoding's session P50 over off's read 0.96-1.04 a round without
    # this (5 of 6 rounds under 1.0, both runs 0.97), 0.96-1.08 with it (4 of 15 under 1.0,
    # the five runs 1.01-1.03). Not for a draft model: skipping a round costs it a catch-up,
    # and the controller charges its admissions instead. Adaptive k only.
    hold_beside_prompts: bool = False
    explore_every: int = 24
    acceptance_prior: float = 0.6
    forget: float = 0.98
    min_position_rounds: float = 4.0  # below this, a position uses the pooled figures
    target_cost: LinearCostModel = field(default_factory=LinearCostModel)
    draft_cost: LinearCostModel = field(default_factory=LinearCostModel)
    _steps: int = 0
    step_overhead_s: float = 0.0  # a step's work besides the target's forward, forgotten average
    _steps_observed: int = 0
    _rng: random.Random = field(default_factory=lambda: random.Random(0))
    last_k: int = 0
    # Index j = draft position (1-based; index 0 unused). See the module docstring.
    _go: list[_Share] = field(default_factory=list)
    _acc: list[_Share] = field(default_factory=list)
    _more: list[_Share] = field(default_factory=list)
    # Forgetting without touching every share per round: each step's rounds weigh 1/forget
    # times more than the step before's; a share's count in rounds is its weight / _unit.
    # Per step, not per round: per round, batch 4 forgot four times faster in time, its
    # acceptance followed the last ~12 steps' text (each batch of prompts differs), and the
    # bound ruled batch 4 greedy out, then in, where fixed k = 2 paid 1.09x of off (built-in
    # pair, 2 AVX-512 cores; adaptive 0.99x per round, 1.01-1.06x per step, 40 batches).
    _unit: float = 1.0
    _unit_step: int = -1  # the controller's step count when _unit last grew
    # The first step after a switch is not steady and the last is reported after the next
    # choice: 3 measured steps when it ends.
    explore_len: int = 5
    # Off's first steady steps after speculation ran slower than its later ones (built-in
    # pair, batch 1, AVX-512: 1.12, 0.98, 0.94, 0.90 ms, then 0.83-0.86): measured in off's
    # probes alone while speculating, off read ~17% slow and k = 1 stayed on at 0.83x of off.
    # So off's first ``off_settle_steps`` steady steps after a step with drafts stay out of its
    # window, and off's probes while speculating last that much longer.
    off_settle_steps: int = 2
    _last_spec_step: int = -(10**9)  # the controller's step count at the last step reported with k > 0
    # The same the other way: the first steps with drafts after off ran slower than later ones
    # (the draft catching up, the caches holding the target alone: 1.78, 1.51, 1.48, 1.44 ms,
    # then 1.29 steady, batch 1 sampled, AVX-512), and a three-step exploration read k ~15%
    # dearer than it runs, which decided against k and, as the ceiling's anchor, ruled out a
    # greedy batch 1 where k = 2 ran 1.26x of off (2 AMD EPYC cores). So after off, k's first
    # ``spec_settle_steps`` steady steps stay out of its window, and an exploration of k > 0
    # from off lasts that much longer.
    spec_settle_steps: int = 2
    _reported_k: int = 0  # the k of the last step reported
    _spec_run_start: int = -(10**9)  # the controller's step count when a run of drafts after off was first reported
    switch_margin: float = 0.05  # speculation stays on only while measured >= 5% above off
    # ... and switches on at 7% above: twice the margin (before the windows' noise was taken
    # out) kept k = 1, 1.2x off at batch 1, off for most of a cold run (AVX2, built-in pair).
    switch_on_margin: float = 0.07
    # Measured throughput: (batch bucket, k) -> its last rate_window steady steps.
    rate_window: int = 32
    min_rate_steps: int = 3
    rates: dict[tuple[int, int], _RateWindow] = field(default_factory=dict)
    # "throughput": tokens/s; "goodput": tokens/s of the requests that meet slo's bounds.
    objective: str = "throughput"
    slo: SloBounds | None = None
    num_goodput_overrides: int = 0  # steps where goodput chose another k than throughput would
    _prev_k: int = -1
    _last_b: int = 0
    _explore_left: int = 0
    _explore_k: int = 0
    _explore_bucket: int = -1
    _explore_turn: int = 0
    # Per batch bucket: exploration interval multiplier (doubles, up to max_backoff, while the
    # explorations keep confirming speculation off there) and steps since its last one.
    # An exploration of k > 0 after a long time off costs the draft a catch-up over every token
    # generated meanwhile (~0.1 s for 16 requests x 180 tokens on the built-in draft, AVX-512):
    # about what keeping it in step all along would have cost. So confirmed-off buckets double
    # their interval with no practical bound.
    max_backoff: int = 1024
    # A lookup (n-gram, suffix) has no catch-up: an exploration where it finds no match drafts
    # nothing and costs nothing, one whose drafts are rejected is charged to the bucket's budget
    # (``_min_interval``). So a lookup's confirmed-off bucket backs off to at most this many
    # times explore_every, and a text that starts repeating is found within about a thousand
    # steps (the rate windows take a few explorations to forget): suffix decoding at
    # temperature 0.8, seeded, ran the repeated pass of bench_suffix.py at 1.02x of plain in a
    # run where the cold pass (drafts rejected) had decided off and backed off, 2.1x in one
    # where it had not (AVX-512, built-in target).
    LOOKUP_MAX_BACKOFF = 4
    # While on, explorations that confirm speculation on (the decision after them keeps a k >
    # 0, the same or another) come half as often each time, down to 1 in ``max_on_backoff`` x
    # explore_every steps; a switch on or off brings them back to every explore_every. An off
    # probe while on costs its own slower steps and, on return, the draft's catch-up over
    # them: at batch 4 greedy (built-in pair, 2 AVX-512 cores) ~15% of an on bucket's steps
    # were such probes, one every 24-30 steps, and adaptive kept 0.97-1.06x of off where fixed
    # k = 2 ran 1.03-1.15x. Off's window stays as old as the interval (~0.4 s at batch 4):
    # the machine's drift over minutes is not what it compares.
    max_on_backoff: int = 8
    _backoff: dict = field(default_factory=dict)
    _since_explore: dict = field(default_factory=dict)
    # The most a bucket's periodic explorations may cost, as a share of its time: each
    # exploration's cost (its seconds beyond what the k in use would have taken for the same
    # tokens, the draft's catch-up included) sets how many steps must pass before the next.
    explore_budget: float = 0.01
    _min_interval: dict = field(default_factory=dict)  # per bucket: steps, from the last exploration's cost
    _probe: dict | None = None  # the exploration being costed (see ``_cost_exploration``)
    _judge_bucket: int | None = None  # an exploration just ended here: its verdict is pending
    _greedy: bool = False  # the batch class of the choice being made (see ``bucket``)
    _decided: dict[int, int] = field(default_factory=dict)  # per bucket: the last k decided (not explored)
    _expected: list[float] | None = None  # expected_accepted per cap, until the next round comes in
    _figures: list[tuple[float, float]] | None = None  # round figures per cap, until the next round comes in
    _admissions: dict[int, _Admissions] = field(default_factory=dict)  # per batch bucket
    decide_every: int = 8  # steps a bucket's decision holds (explorations still come when due)
    _held: dict[int, list[int]] = field(default_factory=dict)  # per bucket: [k, steps it still holds]
    # The start-up profile of verification's cost (None: none taken; every bucket explores).
    # Buckets where no k could reach switch_on_margin above off at an optimistic acceptance
    # are ruled out: k = 0 there with no exploration and no bookkeeping (see ``_cannot_pay``).
    cost_profile: VerifyCostProfile | None = None
    # The acceptance the bound assumes: this, weighted as ``ceiling_prior_rounds`` rounds,
    # pooled with the rounds verified so far: optimistic while none is (0.6-0.8 is typical of
    # a draft model), what was measured once many are.
    ceiling_acceptance_prior: float = 0.9
    # ... counted as this many rounds: an exploration verifies 5-7, and at batch 1 greedy the
    # first 28 read 0.58 where other runs read 0.8-0.88 (the acceptance varies with the text).
    ceiling_prior_rounds: float = 16.0
    ruled_out: dict[int, int] = field(default_factory=dict)  # bucket -> rounds verified at the verdict
    # A bucket ruled out on the acceptance measured so far (one that could pay at
    # ``recheck_acceptance``) is also weighed again by drafting, after
    # ``ruled_out_recheck_steps`` of the controller's steps, doubling each time it is ruled
    # out again (up to max_backoff x explore_every) and never sooner than its last
    # exploration's cost allows (``_min_interval``): only drafting measures the acceptance
    # that ruled it out, and in a workload that runs in one bucket no round is verified
    # elsewhere. Greedy batch 1 on the built-in pair (2 AVX2 cores) ran 1.07-1.12x of off in
    # some runs and was ruled out for good after a stretch of hard text in others (0.98-1.00x).
    #
    # A recheck costs what a first exploration does (the draft catches up on every running
    # request's context) and, in a bucket that stays ruled out, buys nothing: at batch 4,
    # temperature 0.8 on the built-in pair with the W8A8 draft (2 Xeon cores) each cost 12-31 ms,
    # and at 1,536 steps and the 1% exploration budget three of them in 60 batches of 128 tokens
    # were 0.55% of the adaptive engine's time, where its cells of the never-slower matrix read
    # 0.978-0.981x of off. So rechecks start at 3,072 steps and keep to ``recheck_budget``.
    ruled_out_recheck_steps: int = 3072
    recheck_budget: float = 0.005
    recheck_acceptance: float = 0.95
    _ruled_at: dict = field(default_factory=dict)  # per bucket: the step count when ruled out
    _recheck_every: dict = field(default_factory=dict)  # per bucket: steps from then to its recheck
    num_rechecks: int = 0  # ruled-out buckets weighed again by drafting (tests, docs)
    # Per-token acceptance of greedy (True) and sampled (False) requests' rounds, all positions
    # pooled, for the bound alone: a greedy request accepts more (0.76-0.85 against ~0.68 at
    # temperature 0.8, built-in pair), and pooled with greedy rounds a sampled bucket's bound
    # stayed optimistic long after a greedy phase.
    _class_acc: dict[bool, _Share] = field(default_factory=lambda: {False: _Share(), True: _Share()})
    # Per bucket: the k the bound found best at its last weighing (probed while off, see
    # ``choose_k``).
    _bound_k: dict[int, int] = field(default_factory=dict)
    _rounds_verified: int = 0
    # A bucket's first exploration with drafts costs more than any later one (the draft model
    # catches up on every running request's whole context) and a cold run may end before it
    # pays: a request of 128 tokens at batch 1 is ~0.15 s here, and its one exploration cost
    # 5-11% of that (AVX2, built-in pair). So where the proposer catches up, it waits until its
    # cost, by the profile, fits ``explore_budget`` of the bucket's horizon: the longer of the
    # time the bucket has run and the time its requests may still run (``BatchOutlook``).
    # Buckets that have drafted:
    _drafted: set = field(default_factory=set)
    _bucket_s: dict = field(default_factory=dict)  # per bucket: seconds of steps reported there before it drafted
    num_first_explorations_waited: int = 0  # times a first exploration was put off (tests, docs)
    _shapes: dict = field(default_factory=dict)  # (decoding requests, greedy) -> (k_cap, bucket)
    _first_wait_until: dict = field(default_factory=dict)  # per bucket: the step its first exploration is weighed again
    # Quiet steps. Where k = 0 stands (a bucket ruled out, a decision of k = 0 held, no k
    # fitting the rows), a decode step's report changes nothing a choice reads soon: one in
    # ``quiet_report_every`` is reported (keeping off's window, the cost model and the
    # bucket's time current) and the rest are not measured at all (``last_round`` None). The
    # reports cost ~15 us a step on 2 AVX2 cores beside a ~1.1 ms batch-1 step: what kept an
    # adaptive engine that does not draft 1-2% under speculation off (docs/speculative.md).
    quiet_report_every: int = 8
    # ... and one in this many where no k fits the rows or the bucket is ruled out: there a
    # report feeds only the target's cost model and the bucket's time (its windows are not
    # kept), and the reported step and the one that observes it cost ~15-25 us more than a
    # quiet one after a forward (2 AVX2 cores, batch 1): ~4 us a step at one in eight.
    ruled_out_report_every: int = 64
    _quiet_count: int = 0
    _unreported: bool = False  # the choice just made is a quiet step's, left unreported
    # Per bucket: [steps, tokens] of its quiet steps left unreported since its last decode
    # step report (which stands for them: the bucket's time, its tokens per admission).
    _skipped: dict = field(default_factory=dict)
    num_quiet_steps: int = 0  # steps left unreported (tests, docs)
    # A quiet step's lease: the next decode steps at the same batch size and class that the
    # branch which made this one quiet would make quiet too, taken by ``take_quiet_step``
    # without a decision and counted at the next one (``_settle``). What those branches read
    # changes only by a report, a verified round or the step count, so a lease ends at the
    # next report due (``quiet_report_every`` or ``ruled_out_report_every``) or exploration
    # due, and any observation that could change those branches ends it (a verified round, a
    # report of drafts or of an exploration, a window measured for the first time). Measured
    # after a forward (2 AVX2 cores, built-in pair, batch 1, an engine whose draft model never
    # drafted): a quiet decision ~4 us and reserving around it as much again, ~12 us a step
    # beside an engine without a draft model; ~9 us with leases, ~4 us once a ruled-out
    # bucket reports one step in ``ruled_out_report_every``.
    _lease: _Lease | None = None
    # A batch that shrinks keeps the k of the larger bucket it shrank from: for up to
    # ``drain_inherit_steps`` steps after that bucket (same class) last decided a k > 0, a
    # smaller bucket takes that k (within its own cap) with no decision or exploration of its
    # own. What pays at a batch size pays at a smaller one (verification rows cost least where
    # they are fewest: on the built-in pair k pays ~1.5x at batch 1 greedy, ~1.05x at batch
    # 4), and the draft is in step there, having just drafted for every request. Drafts make a
    # closed batch's requests finish apart: traced at batch 4 greedy with k = 2-3 on (2
    # AVX-512 cores), 5-17 of a batch's 48-61 steps ran at batch 1-3, mostly off there (those
    # buckets' windows measured only such tails, a few steps at a time), one token per request
    # a step at ~3x a batch-4 step's cost per token, and their first explorations caught the
    # draft up on whole contexts. Bounded in steps: a load that stays smaller decides for itself.
    drain_inherit_steps: int = 24
    _on_from: tuple[int, int, int] | None = None  # (bucket, k, step count) of the last decision of a k > 0
    num_inherited_steps: int = 0  # steps that took a larger bucket's k (tests, docs)

    def __post_init__(self) -> None:
        n = self.k_max + 1
        self._go = [_Share() for _ in range(n)]
        self._acc = [_Share() for _ in range(n)]
        self._more = [_Share() for _ in range(n)]

    @property
    def acceptance_rate(self) -> float:
        """Per-token acceptance a over all positions: accepted / (accepted + rejections),
        the maximum-likelihood estimate for a geometric number of accepted drafts."""
        return self._pooled(self._acc, self.acceptance_prior)

    def _pooled(self, shares: list[_Share], prior: float, prior_rounds: float = 4.0) -> float:
        weight = prior_rounds * self._unit  # the prior counts as this many rounds
        hits = sum(s.hits for s in shares)
        trials = sum(s.trials for s in shares)
        return (hits + weight * prior) / (trials + weight)

    def _share(self, shares: list[_Share], j: int, pooled: float) -> float:
        s = shares[min(j, self.k_max)]
        return s.hits / s.trials if s.trials >= self.min_position_rounds * self._unit else pooled

    def observe_round(self, accepted: int, num_drafts: int, cap: int | None = None, greedy: bool = False) -> None:
        """One request's verification: ``accepted`` of ``num_drafts`` drafts kept, drafted
        under cap ``cap`` (default: num_drafts, i.e. the chain was not cut short);
        ``greedy``: the request samples greedily."""
        if num_drafts <= 0:
            return
        if self._lease is not None:
            self._settle()
        cap = num_drafts if cap is None else cap
        self._expected = self._figures = None
        self._rounds_verified += 1
        if self._steps != self._unit_step:  # forgotten per step: a batch's rounds weigh alike
            self._unit /= self.forget
            self._unit_step = self._steps
        if self._unit > 1e100:  # rescale long before float range runs out
            for shares in (self._go, self._acc, self._more, self._class_acc.values()):
                for sh in shares:
                    sh.hits /= self._unit
                    sh.trials /= self._unit
            self._unit = 1.0
        w = self._unit
        top = min(num_drafts, self.k_max)
        by_class = self._class_acc[greedy]
        by_class.hits += min(accepted, top) * w
        by_class.trials += min(accepted + 1, top) * w
        for j in range(1, top + 1):
            if j < cap:
                self._more[j].add(j < num_drafts, w)
            if j <= accepted + 1:  # verification reached draft j
                self._acc[j].add(j <= accepted, w)
                if j < cap:
                    self._go[j].add(j <= accepted and j < num_drafts, w)

    def observe_step(self, num_tokens: int, forward_s: float, other_s: float) -> None:
        """A decode/verify step: the target's forward (with sampling) over ``num_tokens``
        tokens took ``forward_s``; the rest of the step ``other_s``."""
        self.target_cost.observe(num_tokens, forward_s)  # not read by a quiet branch: a lease stands
        f = self.target_cost.forget
        self.step_overhead_s = other_s if self._steps_observed == 0 else f * self.step_overhead_s + (1 - f) * other_s
        self._steps_observed += 1

    def round_figures(self, cap: int) -> tuple[float, float]:
        """(tokens, drafts) per request per round expected under ``cap``."""
        return self._all_round_figures(cap)[cap - 1]

    def _all_round_figures(self, k_max: int) -> list[tuple[float, float]]:
        """round_figures for caps 1..k_max (kept until the next round is verified: a decision
        reads them several times)."""
        if self._figures is None:
            self._figures = self._round_figures_to(self.k_max)
        return self._figures[:k_max]

    def _round_figures_to(self, k_max: int) -> list[tuple[float, float]]:
        """round_figures for caps 1..k_max in one pass (each cap extends the one below)."""
        acc_all = self.acceptance_rate
        more_all = self._pooled(self._more, 1.0)
        go_all = self._pooled(self._go, acc_all * more_all)
        tokens, drafts = 1.0, 0.0
        reach, exists = 1.0, 1.0
        out = []
        for j in range(1, k_max + 1):
            drafts += exists
            tokens += reach * self._share(self._acc, j, acc_all)
            reach *= self._share(self._go, j, go_all)
            exists *= self._share(self._more, j, more_all)
            out.append((tokens, drafts))
        return out

    @staticmethod
    def bucket(num_decoding: int, greedy: bool = False) -> int:
        """Batch-size bucket: 1, 2, 3-4, 5-8, 9-16, ... -> 0, 2, 4, 6, 8, ... (+ 1 for a
        batch of greedy requests only: their acceptance, and so what k buys, differs from a
        sampled batch's, and a server that alternates between the two should not carry one's
        measurements over to the other)."""
        return 2 * max(num_decoding - 1, 0).bit_length() + bool(greedy)

    @property
    def last_round(self) -> tuple[int, int, bool, bool] | None:
        """The choice just made: (decoding requests, k, whether the previous step chose the
        same k, whether they were all greedy); None for a quiet step, which the engine need
        not measure (see ``quiet_report_every``). A step's measured throughput is reported
        with it (``observe_throughput``), since the engine learns a step's whole cost only
        after the next choice is made."""
        if self._unreported:
            return None
        return self._last_b, self.last_k, self._prev_k == self.last_k, self._greedy

    def _quiet(self, bkt: int | None, num_decoding: int, decode_only: bool, every: int | None = None) -> bool:
        """Whether a step of k = 0 that stands goes unreported (all but one in ``every``,
        default ``quiet_report_every``). Never a step with prompt tokens (admissions are measured
        apart, each one), nor while an exploration is costed or the last step reported had
        drafts (the first off steps after drafts are told apart by their reports).
        ``bkt``: the bucket whose reports stand for the step (None: none read them)."""
        if not decode_only or self._probe is not None or self._reported_k:
            return False
        self._quiet_count += 1
        if self._quiet_count % (every or self.quiet_report_every) == 0:
            return False
        self.num_quiet_steps += 1
        if bkt is not None:
            skipped = self._skipped.get(bkt)
            if skipped is None:
                self._skipped[bkt] = [1, num_decoding]
            else:
                skipped[0] += 1
                skipped[1] += num_decoding  # k = 0, decode only: one token a request
        return True

    def _grant_lease(self, num_decoding: int, greedy: bool, bkt: int | None, due_in: int | None = None,
                     every: int | None = None, held: bool = False) -> None:
        """After a quiet step: how many more the same branch would make quiet (``_lease``),
        up to the next report (one in ``every`` quiet steps) and the step before its bucket's
        next exploration or recheck is due (``due_in``); ``held``: a held decision's, whose
        steps count toward its bucket's next exploration."""
        every = every or self.quiet_report_every
        left = every - 1 - self._quiet_count % every
        if due_in is not None:
            left = min(left, due_in)
        self._lease = _Lease(num_decoding, greedy, bkt, left, held) if left > 0 else None

    def take_quiet_step(self, num_decoding: int, greedy: bool) -> bool:
        """Whether a decode-only step of ``num_decoding`` requests (all greedy or not) is one
        more quiet step of k = 0 under the lease (``_lease``): then it is counted as such at
        the next decision, and k and ``last_round`` are as after the step that granted it
        (0 and None). False: call ``choose_k``."""
        lease = self._lease
        if lease is None or lease.left <= 0 or lease.num_decoding != num_decoding or lease.greedy != greedy:
            return False
        lease.left -= 1
        lease.taken += 1
        return True

    def _settle(self, keep: bool = False) -> None:
        """Count the steps taken under the lease as ``_quiet`` and ``choose_k`` would have,
        one by one, and end it (``keep``: let the rest of it stand)."""
        lease = self._lease
        assert lease is not None
        if not keep:
            self._lease = None
        n = lease.taken
        if not n:
            return
        lease.taken = 0
        num_decoding, greedy, bkt = lease.num_decoding, lease.greedy, lease.bucket
        self._steps += n
        self._quiet_count += n
        self.num_quiet_steps += n
        if bkt is not None:
            skipped = self._skipped.get(bkt)
            if skipped is None:
                self._skipped[bkt] = [n, n * num_decoding]
            else:
                skipped[0] += n
                skipped[1] += n * num_decoding
            if lease.held:
                self._since_explore[bkt] = self._since_explore.get(bkt, 0) + n
        self._prev_k, self.last_k, self._last_b, self._unreported, self._greedy = 0, 0, num_decoding, True, greedy

    def observe_throughput(self, num_tokens: int, seconds: float, num_decoding: int, k: int, steady: bool,
                           greedy: bool = False, num_rounds: int = 0, num_accepted: int = 0,
                           decode_only: bool = True, propose_s: float = 0.0, computed_tokens: int = 0) -> None:
        """A step with ``num_decoding`` decoding requests drafting ``k`` (its ``last_round``)
        emitted ``num_tokens`` tokens in ``seconds`` of whole step, ``num_accepted`` of them
        accepted drafts of the ``num_rounds`` requests that verified drafts in it; its
        proposal took ``propose_s``, and the target computed ``computed_tokens``. A
        decode-only step counts for its k only when the previous step chose the same k
        (steady state); a step with prompt tokens (one that admits a request) counts apart,
        see ``_with_admissions``."""
        if self._lease is not None:
            # The report of a k = 0 step outside an exploration changes nothing a quiet branch
            # reads (the last k reported stays 0): the lease stands, its steps counted so far.
            self._settle(keep=k == 0 and self._probe is None)
        if self.fixed_k is not None or seconds <= 0 or num_decoding <= 0:
            return
        if self._probe is not None and decode_only:
            # A step that admits a request pays its prompt's prefill whatever k is (what drafts
            # add to admissions is charged apart, ``_with_admissions``): costed here, a 1,800-token
            # prefill inside one exploration set its bucket's next 3,795 steps away, and suffix
            # decoding stayed off for a whole run of repeated requests (AVX-512, built-in target).
            self._cost_exploration(num_tokens, seconds)
        if k > 0:
            self._last_spec_step = self._steps
            if self._reported_k == 0:
                self._spec_run_start = self._steps
        self._reported_k = k
        shape = self._shapes.get((num_decoding, greedy))
        if shape is not None and shape[0] == 0:
            return  # no k fits these rows (k_cap 0): nothing measured here is ever compared
        bkt = self.bucket(num_decoding, greedy)
        # A decode step's report stands for the bucket's quiet steps left unreported since
        # the last one (k = 0 decode steps like it): their time and tokens count here.
        skipped = self._skipped.pop(bkt, None) if decode_only else None
        steps, extra_tokens = (1, 0) if skipped is None else (1 + skipped[0], skipped[1])
        if bkt not in self._drafted:  # read only to weigh the bucket's first exploration
            self._bucket_s[bkt] = self._bucket_s.get(bkt, 0.0) + seconds * steps
        if bkt in self.ruled_out:
            return  # k = 0 for good here: nothing to compare
        adm = self._admissions.get(bkt)
        if adm is None:
            adm = self._admissions[bkt] = _Admissions()
        adm.observe(num_tokens + extra_tokens, not decode_only, k, seconds, propose_s, computed_tokens)
        if not decode_only or not steady:
            return
        if k == 0 and self._steps - self._last_spec_step <= 1 + self.off_settle_steps:
            return  # the first off steps after drafts (the very first is not steady)
        if k > 0 and self.spec_settle_steps and self._steps - self._spec_run_start <= self.spec_settle_steps:
            return  # the first steps with drafts after off (the very first is not steady)
        key = (bkt, k)
        window = self.rates.get(key)
        if window is None:
            window = self.rates[key] = _RateWindow(self.rate_window)
        window.add(num_tokens, seconds, self._steps, num_rounds, num_accepted, gap=steps)
        if len(window.steps) == self.min_rate_steps:
            self._held.pop(bkt, None)  # a k measured for the first time here: decide afresh
            self._lease = None

    def measured_rate(self, num_decoding: int, k: int) -> float | None:
        """Tokens/s measured with ``k`` at this batch size, for the batch class (greedy or
        not) of the choice being made."""
        return self._bucket_rate(self.bucket(num_decoding, self._greedy), k)

    def _bucket_rate(self, bkt: int, k: int) -> float | None:
        window = self.rates.get((bkt, k))
        if window is None or len(window.steps) < self.min_rate_steps:
            return None
        return self._with_admissions(window.rate(self.expected_accepted(k)), bkt, k)

    def _with_admissions(self, decode_rate: float, bkt: int, k: int) -> float:
        """Tokens/s over decode steps at ``decode_rate``, with what admitting requests adds to
        k's steps (``_Admissions.extra_s``) at the bucket's admissions per token. Admission
        steps stay out of the windows: at batch 1 a 28 ms admission step beside 6 ms decode steps moved a
        32-step window's rate by 15% depending on whether one fell inside it (AVX2, built-in
        pair), which decided between k's that differed by less. The target's own prefill is
        paid whatever k is, and is left out of every k's rate alike. At saturation, where
        most steps admit, what speculation adds to them still counts: with no admission
        step counted at all, the controller speculated into a queue (docs/speculative.md)."""
        return 1.0 / (1.0 / decode_rate + self._admission_s_per_token(bkt, k))

    def _admission_s_per_token(self, bkt: int, k: int) -> float:
        """Seconds that admitting requests adds to ``k``'s steps, per token emitted (the
        bucket's admissions per token times ``_Admissions.extra_s``; 0 for k = 0 or unseen)."""
        adm = self._admissions.get(bkt)
        extra = None if k <= 0 or adm is None or adm.tokens <= 0 else adm.extra_s()
        return 0.0 if extra is None else adm.admissions / adm.tokens * extra

    def expected_accepted(self, k: int) -> float | None:
        """Accepted drafts a round is expected to yield under cap ``k`` (None for k = 0),
        from the acceptance figures of every round verified (see ``_RateWindow._tokens``)."""
        if k <= 0:
            return None
        if self._expected is None:
            self._expected = [f[0] - 1.0 for f in self._all_round_figures(self.k_max)]
        return self._expected[min(k, self.k_max) - 1]

    def _measured_rates(self, num_decoding: int, cap: int) -> dict[int, float]:
        """k -> measured_rate for the k in 0..cap measured in this bucket (one decision reads
        them several times)."""
        bkt = self.bucket(num_decoding, self._greedy)
        return {k: r for k in range(cap + 1) if (r := self._bucket_rate(bkt, k)) is not None}

    @staticmethod
    def _best_measured(measured: dict[int, float]) -> tuple[int, float | None]:
        """The measured k > 0 with the highest rate (0, None: none)."""
        return max(((k, r) for k, r in measured.items() if k > 0), key=lambda kr: kr[1], default=(0, None))

    def _set(self, k: int, num_decoding: int, quiet: bool = False) -> int:
        self._prev_k, self.last_k, self._last_b, self._unreported = self.last_k, k, num_decoding, quiet
        return k

    def k_cap(self, num_decoding: int) -> int:
        """The largest k allowed at ``num_decoding`` decoding requests."""
        if self.max_rows is None:
            return self.k_max
        return max(0, min(self.k_max, self.max_rows // max(num_decoding, 1) - 1))

    def choose_k(self, num_decoding: int, slo_state: SloState | Callable[[], SloState] | None = None,
                 greedy: bool = False, outlook: Callable[[], BatchOutlook] | None = None,
                 decode_only: bool = True) -> int:
        """k for the next round at ``num_decoding`` decoding requests, all greedy or not
        (``slo_state``: what the goodput objective needs, or a callable that builds it,
        called only when a goodput decision reads it; ignored under throughput;
        ``outlook``: the batch's remaining and context tokens, called only when a bucket's
        first exploration with drafts is weighed; None: it never waits; ``decode_only``: the
        step schedules no prompt tokens, so it may be a quiet one, see ``last_round``)."""
        if self._lease is not None:
            self._settle()
        self._greedy = greedy
        if self.fixed_k is not None:
            self.last_k = self.fixed_k
            return self.fixed_k
        self._steps += 1
        if num_decoding <= 0:
            return 0
        shape = self._shapes.get((num_decoding, greedy))
        if shape is None:  # k_max and max_rows are fixed: one look-up a step instead of two calls
            shape = self._shapes[(num_decoding, greedy)] = (self.k_cap(num_decoding), self.bucket(num_decoding, greedy))
        cap, bkt = shape
        if cap == 0:
            # No k fits the rows: nothing to explore either, and no report is read but the
            # cost model's.
            every = self.ruled_out_report_every
            quiet = self._quiet(None, num_decoding, decode_only, every)
            if quiet:
                self._grant_lease(num_decoding, greedy, None, every=every)
            return self._set(0, num_decoding, quiet)
        if self._explore_left > 0:
            if bkt == self._explore_bucket:
                self._explore_left -= 1
                return self._set(min(self._explore_k, cap), num_decoding)
            # The batch moved to another bucket mid-exploration: what it would measure belongs
            # to the old one. Carried over, the k = 8 of a batch-1 exploration at a load's tail
            # ran as k = 3 over the next load's four fresh requests (0.84x of off there).
            self._explore_left = 0
        on = self._on_from
        if on is not None and on[0] > bkt and not (on[0] - bkt) % 2 \
                and self._steps - on[2] <= self.drain_inherit_steps:
            self.num_inherited_steps += 1
            return self._set(min(on[1], cap), num_decoding)
        if bkt in self.ruled_out:
            # Ruled out until rounds verified elsewhere (other batch sizes) move the acceptance
            # the bound assumes: weighed again once every 16 of them, not every step.
            recheck_at = self._recheck_at(bkt)
            if recheck_at is not None and self._steps >= recheck_at \
                    and not self._ends_first(outlook() if outlook is not None else None):
                # Weighed again by drafting: the bound's best k at the acceptance it could pay
                # at, for one exploration; the decision after it weighs the bound afresh.
                del self.ruled_out[bkt]
                self._held.pop(bkt, None)
                self.num_rechecks += 1
                return self._explore(max(min(self._bound_k.get(bkt, 1), cap), 1), bkt, num_decoding)
            if self._rounds_verified < self.ruled_out[bkt] + 16:
                every = self.ruled_out_report_every
                quiet = self._quiet(bkt, num_decoding, decode_only, every)
                if quiet:
                    self._grant_lease(num_decoding, greedy, bkt, None if recheck_at is None
                                      else recheck_at - self._steps - 1, every=every)
                return self._set(0, num_decoding, quiet)
            if self._cannot_pay(bkt, num_decoding):
                self._rule_out(bkt, num_decoding)
                return self._set(0, num_decoding)
            del self.ruled_out[bkt]
            self._held.pop(bkt, None)
        since = self._since_explore.get(bkt, 0) + 1
        interval = self._explore_interval(bkt, since)
        due = since >= interval
        held = self._held.get(bkt)
        if held is not None and held[1] > 0 and not due:
            # The bucket's last decision holds for decide_every steps: its windows move by a
            # step or two meanwhile, and deciding afresh each step cost ~120 us of Python, 5%
            # of a 2.4 ms batch-1 step, paid with speculation off too. The goodput objective's
            # decisions hold as long (they read the requests' SLO state, which moves each step,
            # but a held k lasts ~8 steps, tens of ms, and deciding every step made its server
            # deliver 5% fewer requests in bound than off's at 0.75x of saturation while it
            # drafted almost nothing, the throughput objective's 2%). Checked before anything
            # reads a window: off's rate alone, re-summed each step, took ~33 us under cProfile
            # (~2% of a 1.4 ms batch-4 step, AVX-512). A held decision was made after off and
            # both cost models were measured, so the checks below would pass.
            self._since_explore[bkt] = since
            quiet = held[0] == 0 and self._quiet(bkt, num_decoding, decode_only)
            if quiet:
                self._grant_lease(num_decoding, greedy, bkt, interval - since - 1, held=True)
            else:
                # A decision holds for decide_every *reported* steps: k = 0 decided afresh on
                # the same windows (a quiet step adds nothing to them) decides the same, and a
                # decision reads every window (~100-200 us on 2 AVX2 cores after a forward).
                held[1] -= 1
                self._note_decision(bkt, held[0])
            return self._set(held[0], num_decoding, quiet)
        off = self.measured_rate(num_decoding, 0)
        if off is None or not self.target_cost.ready:
            return self._explore(0, bkt, num_decoding)  # measured first: speculation off
        if self._cannot_pay(bkt, num_decoding):
            self._rule_out(bkt, num_decoding)
            self._decided[bkt] = 0
            self._note_decision(bkt, 0)
            return self._set(0, num_decoding)
        if not self.draft_cost.ready:
            return self._explore_drafts(1, bkt, num_decoding, outlook)  # the draft's cost, at the cheapest k
        self._since_explore[bkt] = since
        measured = self._measured_rates(num_decoding, cap)
        model_k, best_pos = self._model_choice(num_decoding, cap, measured)
        if due:
            # Keep the cost fits and the measured rates fresh. While on: off, then another k (at
            # most one above the model's best k > 0: a long draft at a large batch costs). While
            # off: the k the bound (``_cannot_pay``, just weighed) finds best where it has not
            # been measured here, so that each exploration either finds the k that pays or
            # takes it out of the bound, then the cheaper ones it has not measured, largest
            # first (batch 4 greedy, built-in pair, 2 AVX-512 cores: the bound said k = 3, k = 1
            # and 3 measured at off's rate, and k = 2, which ran 1.06x of off as a fixed k, was
            # never measured); else the k that the next decision will weigh against
            # off (the best measured one, else k = 1, the cheapest probe), so that what decides
            # was measured lately: one bad window of the model's k = 8, never run again, kept
            # speculation off for the rest of a batch-1 run where k = 1 measured 1.2x off (AVX2,
            # built-in pair). Probing only that k, a batch-1 sampled bucket whose bound said
            # k = 4-5 could pay 1.10-1.16x (from k = 1's step alone) kept exploring k = 1 for
            # 11-62 rounds, each exploration 7-18 ms, until its acceptance drifted low. Each
            # exploration also costs the draft a catch-up over every token generated since it
            # last ran, which the exploration budget charges to the bucket.
            self._since_explore[bkt] = 0
            self._judge_bucket = bkt
            if self._decided.get(bkt, 0) == 0:
                bound_k = min(self._bound_k.get(bkt, 0), cap)
                unmeasured = [k for k in range(bound_k, 0, -1) if k not in measured]
                probe_k = unmeasured[0] if unmeasured else self._best_measured(measured)[0] or 1
                return self._explore_drafts(probe_k, bkt, num_decoding, outlook)
            turn = self._explore_turn
            self._explore_turn += 1
            cur = self._decided[bkt]
            others = [k for k in range(1, min(cap, best_pos + 1) + 1) if k != cur]
            alt = best_pos if best_pos != cur else self._rng.choice(others) if others else 0
            return self._explore(alt if turn % 2 else 0, bkt, num_decoding)
        k = 0
        best_k, best = self._best_measured(measured)
        if model_k > 0 or best is not None:
            # Measured beats modelled: the best measured k, with a margin towards off (see the
            # module docstring); the model's k is measured before off is concluded (the model
            # finds a k worth trying, the measurements choose).
            # Whether this bucket was on before (an exploration's own k does not count).
            was_on = self._decided.get(bkt, 0) > 0
            margin = self.switch_margin if was_on else self.switch_on_margin
            cand, on = best_k, best
            if model_k > 0 and (on is None or on < off * (1.0 + margin)) and model_k not in measured:
                cand, on = model_k, None
            if on is None:
                self._judge_bucket = bkt  # its verdict sets the bucket's backoff too
                return self._explore_drafts(cand if cand else best_pos, bkt, num_decoding, outlook)
            if on >= off * (1.0 + margin):
                if not was_on and self._stale_off(bkt, cand):
                    # Switching on needs off measured again after the candidate: windows taken
                    # minutes apart compare the machine's drift (±10-25% here), not k.
                    self._judge_bucket = bkt
                    return self._explore(0, bkt, num_decoding)
                if was_on or self._last_runs_agree(bkt, cand, margin):
                    k = cand
        if self.objective == "goodput" and slo_state is not None:
            k = self._goodput_choice(num_decoding, k, cap, slo_state() if callable(slo_state) else slo_state)
        prev = self._decided.get(bkt, 0)
        if self._judge_bucket == bkt:
            # The first choice after an exploration here: off again means explore less often.
            if k == 0:
                self._backoff[bkt] = min(self._backoff.get(bkt, 1) * 2, self.max_backoff)
            elif prev > 0:  # speculation confirmed on: its probes come half as often, within bounds
                self._backoff[bkt] = min(self._backoff.get(bkt, 1) * 2, self.max_on_backoff)
            else:
                self._backoff[bkt] = 1
            self._judge_bucket = None
        elif (k == 0) != (prev == 0):
            self._backoff[bkt] = 1  # switched on or off between explorations: probed as anew
        self._decided[bkt] = k
        self._held[bkt] = [k, self.decide_every - 1]
        self._note_decision(bkt, k)
        return self._set(k, num_decoding)

    def _note_decision(self, bkt: int, k: int) -> None:
        """Keep where speculation was last decided on, for the smaller buckets a batch shrinks
        to (see ``drain_inherit_steps``); a decision of off there ends it."""
        if k > 0:
            self._on_from = (bkt, k, self._steps)
        elif self._on_from is not None and self._on_from[0] == bkt:
            self._on_from = None

    def _rule_out(self, bkt: int, num_decoding: int) -> None:
        """Rule ``bkt`` out (``_cannot_pay`` said so), with a recheck by drafting where some
        acceptance, ``recheck_acceptance``, could still pay there (see ``ruled_out_recheck_steps``)."""
        self.ruled_out[bkt] = self._rounds_verified
        self._ruled_at[bkt] = self._steps
        if self._cannot_pay(bkt, num_decoding, self.recheck_acceptance):
            self._recheck_every.pop(bkt, None)  # no text would make it pay: never weighed by drafting
            return
        prev = self._recheck_every.get(bkt)
        self._recheck_every[bkt] = self.ruled_out_recheck_steps if prev is None else \
            min(2 * prev, self.max_backoff * self.explore_every)

    def _recheck_at(self, bkt: int) -> int | None:
        """The step count at which ruled-out ``bkt`` is weighed again by drafting (None: never)."""
        every = self._recheck_every.get(bkt)
        if every is None:
            return None
        # _min_interval keeps the last exploration's cost within explore_budget; a recheck, within recheck_budget.
        budgeted = int(self._min_interval.get(bkt, 0) * self.explore_budget / self.recheck_budget)
        return self._ruled_at.get(bkt, 0) + max(every, budgeted)

    def _cannot_pay(self, bkt: int, num_decoding: int, acceptance: float | None = None) -> bool:
        """Whether the start-up profile says no k can beat off by ``switch_on_margin`` in this
        bucket at an optimistic acceptance (``ceiling_acceptance_prior`` pooled with the rounds
        verified for the bucket's batch class, greedy or sampled; the bucket's largest batch
        size profiled; off's measured step; the k measured here, see ``VerifyCostProfile.best_k``;
        the best k is kept in ``_bound_k``, probed while off). Then
        exploring only costs: on 2 AVX-512 cores the built-in target's verification step at
        batch 4 cost 1.75x an off step at k = 1 and 3.1x at k = 3 (the fused layer's products
        cost about linearly in rows past four), and the one exploration a cold run made (its
        steps, the draft's catch-up over the prompts, the requests of a wave finishing apart)
        was most of a 5-7% loss to speculation off. The bound is the policy's own switch-on
        rule at a better acceptance than measured: a bucket it rules out would not have
        switched on. Goodput is no different: a step that emits no more tokens a second
        keeps no more requests within a TPOT bound. ``acceptance``: weigh at this one instead
        (``_rule_out`` asks whether any text could make the bucket pay).

        A bucket speculating now (its last decision k > 0) is weighed at ``switch_margin``, the
        margin that keeps it on, as its measured rates are: at the switch-on margin the bound
        took back what the hysteresis gives. Built-in pair, batch 4 greedy (2 AVX-512 cores,
        where fixed k = 2 ran 1.09x of off that hour): k = 2 on, then ruled out when the bound
        read 1.062x at an acceptance of 0.83, above the margin that keeps it on."""
        profile = self.cost_profile
        if profile is None:
            return False
        top = 1 << max(num_decoding - 1, 0).bit_length()  # the bucket's largest batch size
        on = acceptance is None and self._decided.get(bkt, 0) > 0
        if acceptance is None:
            acceptance = self._pooled([self._class_acc[self._greedy]], self.ceiling_acceptance_prior,
                                      self.ceiling_prior_rounds)
        off_s = self.rates[(bkt, 0)].per_step()[1]
        forward_s = min(self.target_cost.predict(num_decoding), off_s)
        # Every k > 0 measured here costs what it measured, and tells the others' cost.
        measured = {k: window.per_step()[1] for (b, k), window in self.rates.items()
                    if b == bkt and k > 0 and len(window.steps) >= self.min_rate_steps}
        best = profile.best_k(top, off_s, forward_s, acceptance, self._greedy, measured)
        if best is None:
            return False
        self._bound_k[bkt] = best[0]  # at a given acceptance: the k a recheck probes
        return best[1] < 1.0 + (self.switch_margin if on else self.switch_on_margin)

    def goodput(self, num_decoding: int, k: int, state: SloState) -> float | None:
        """Predicted tokens/s of the requests that still meet the bounds after one step with
        ``k``, from this bucket's measured steps (None: k not measured here)."""
        figures = self._goodput_figures(num_decoding, k, state)
        return None if figures is None else figures[0] * figures[1]

    def _goodput_figures(self, num_decoding: int, k: int, state: SloState) -> tuple[int, float] | None:
        """(requests within the bounds after one step with ``k``, tokens/s a request). A
        decoding request stays within the TPOT bound while (seconds since its first token +
        the step) / (tokens after it + the step's tokens a request) does. A request without
        its first token meets the TTFT bound only if its age plus its wait does: the step,
        where it is in prefill or a slot is free for it, else the step plus the time until the
        decoding request that frees its slot has generated its remaining tokens at k's rate a
        request (the n-th queued request past the free slots takes the n-th soonest to
        finish; past them all, the last). So where the batch is full, a k that emits more a
        step admits the queue sooner, which a wait of one step alone cannot see. Each request
        counts at the step's tokens/s a request (one waiting now will decode at about that
        rate). A request preempted after its first token waits as a queued one does and meets
        the TPOT bound only if (its seconds since its first token + its wait) / its tokens
        after it does."""
        bkt = self.bucket(num_decoding, self._greedy)
        window = self.rates.get((bkt, k))
        if window is None or len(window.steps) < self.min_rate_steps:
            return None
        tokens, seconds = window.per_step(self.expected_accepted(k))
        # What admissions add to k's steps, spread over its tokens as the throughput objective
        # counts them (``_with_admissions``): a request decoding beside admissions lives those
        # steps too, and without them goodput read k's steps cheaper than throughput did.
        seconds += tokens * self._admission_s_per_token(bkt, k)
        per_request = tokens / max(num_decoding, 1)
        rate = per_request / seconds  # tokens/s a request
        slo = self.slo or SloBounds()
        ok = 0
        for elapsed, n in zip(state.decode_elapsed_s, state.decode_tokens):
            ok += slo.tpot_s is None or (elapsed + seconds) / (n + per_request) <= slo.tpot_s
        decoded = state.waiting_decoded
        if slo.ttft_s is None and (slo.tpot_s is None or not any(decoded)):
            return ok + len(state.waiting_ages_s), rate
        finish = state.decode_remaining_tokens
        admitted = state.num_prefilling + (len(state.waiting_ages_s) if state.free_slots is None
                                           else state.free_slots)
        for i, age in enumerate(state.waiting_ages_s):
            wait = seconds
            if i >= admitted and finish:
                wait += finish[min(i - admitted, len(finish) - 1)] / rate
            so_far = decoded[i] if decoded else None
            if so_far is None:
                ok += slo.ttft_s is None or age + wait <= slo.ttft_s
            else:
                ok += slo.tpot_s is None or (so_far[0] + wait) / max(so_far[1], 1) <= slo.tpot_s
        return ok, rate

    def _goodput_choice(self, num_decoding: int, k_thr: int, cap: int, state: SloState) -> int:
        """The measured k (0 included) with the most goodput, where it keeps a different
        number of requests within the bounds than throughput's k and beats it by
        switch_margin; else throughput's k (with the same requests in bound, goodput is
        throughput, and throughput's choice carries its measured margins)."""
        incumbent = self._goodput_figures(num_decoding, k_thr, state)
        if incumbent is None:
            return k_thr
        inc_ok, inc_rate = incumbent
        best_k, best = k_thr, inc_ok * inc_rate
        for k in range(cap + 1):
            figures = self._goodput_figures(num_decoding, k, state)
            if figures is not None and figures[0] != inc_ok and figures[0] * figures[1] > best:
                best_k, best = k, figures[0] * figures[1]
        if best_k != k_thr and best > inc_ok * inc_rate * (1.0 + self.switch_margin):
            self.num_goodput_overrides += 1
            return best_k
        return k_thr

    def _stale_off(self, bkt: int, k: int) -> bool:
        """Whether off's window in ``bkt`` has no step newer than ``k``'s newest."""
        off, on = self.rates.get((bkt, 0)), self.rates.get((bkt, k))
        return off is None or on is None or off.last_step < on.last_step

    def _last_runs_agree(self, bkt: int, k: int, margin: float) -> bool:
        """Whether ``k``'s newest stretch beat off's (run after it) by ``margin`` too."""
        on = self._with_admissions(self.rates[(bkt, k)].last_run_rate(self.expected_accepted(k)), bkt, k)
        return on >= self.rates[(bkt, 0)].last_run_rate() * (1.0 + margin)

    def _explore_interval(self, bkt: int, since: int) -> int:
        """Steps from the bucket's last exploration to its next (``since`` of them passed): the
        backed-off interval, what the last exploration's cost allows, and while its first
        exploration with drafts is put off, the step it is weighed again (see ``_explore_drafts``)."""
        interval = max(self.explore_every * self._backoff.get(bkt, 1), self._min_interval.get(bkt, 0))
        wait_until = self._first_wait_until.get(bkt)
        if wait_until is not None and bkt not in self._drafted:
            interval = max(interval, since + wait_until - self._steps)
        return interval

    def _explore_drafts(self, k: int, bkt: int, num_decoding: int,
                        outlook: Callable[[], BatchOutlook] | None) -> int:
        """Explore ``k`` > 0, unless it would be the bucket's first exploration with drafts and
        its cost does not yet fit the budget (see ``_drafted``): then off, held until it is
        weighed again (``_first_exploration_wait``'s steps on: no exploration falls due before);
        nor where the batch's requests end before the exploration would (see ``_ends_first``):
        then off, the exploration due again at the next step."""
        if bkt not in self._drafted and self._steps < self._first_wait_until.get(bkt, 0):
            return self._set(0, num_decoding)  # put off lately: not weighed again each step
        view = outlook() if outlook is not None else None
        if self._ends_first(view):
            self._judge_bucket = None  # nothing explored: no verdict
            self._since_explore[bkt] = self._explore_interval(bkt, 0)
            return self._set(0, num_decoding)
        if bkt not in self._drafted:
            wait = self._first_exploration_wait(bkt, num_decoding, k, view)
            if wait:
                self.num_first_explorations_waited += 1
                self._judge_bucket = None  # nothing explored: no verdict, no backoff
                self._since_explore[bkt] = 0
                self._decided[bkt] = 0
                self._first_wait_until[bkt] = self._steps + wait
                self._held[bkt] = [0, self.explore_every]
                return self._set(0, num_decoding)
        return self._explore(k, bkt, num_decoding)

    def _ends_first(self, view: BatchOutlook | None) -> bool:
        """Whether the batch's requests all end before an exploration from off would: its
        drafts' catch-up then buys no measurement. Drafts make a batch's requests finish apart,
        and the tails of 1-3 requests fall in buckets whose explorations were due: traced at
        batch 4 greedy (built-in pair, 2 AVX-512 cores), a batch-2 tail's step caught the draft
        up on both requests (4.3 ms against ~0.95 for off's step) a step or two before they
        ended, and its own exploration counted as a gain. Requests waiting for a slot take the
        freed ones (the bucket goes on); a request's max_tokens under the exploration's length
        keeps a bucket from exploring while none waits. None: nothing known, explore."""
        return view is not None and not view.num_waiting \
            and view.remaining_tokens < self.explore_len + self.spec_settle_steps

    def _first_exploration_wait(self, bkt: int, num_decoding: int, k: int, view: BatchOutlook | None) -> int:
        """Steps to put off the bucket's first exploration of ``k`` (0: explore now): while it
        costs more, by the start-up profile, than ``explore_budget`` of its horizon (the longer
        of its seconds so far and its requests' remaining tokens at off's measured step), until
        the bucket's own seconds would cover it at off's step, at least ``explore_every`` and at
        most four times that (a longer request may come meanwhile). Each weighing cost ~100-150
        us (the bound, the outlook); weighed every ``explore_every`` steps, that was ~0.6 ms of a
        128-token request's ~90 ms at batch 1 (built-in pair, Xeon). Only where the proposer catches up
        (a draft model): a lookup's first exploration costs no more than its later ones, and
        put off it cost suffix decoding most of its gain on the demo's repeated requests (1.07x
        at 0.33 drafts a token, against 1.25-1.37x at 0.80-0.82 exempt, the same hour, AVX2)."""
        off = self.rates.get((bkt, 0))
        if view is None or self.cost_profile is None or self.cost_profile.catch_up_s_per_token <= 0 \
                or off is None or len(off.steps) < self.min_rate_steps:
            return 0
        off_s = off.per_step()[1]
        top = 1 << max(num_decoding - 1, 0).bit_length()  # the bucket's largest batch size
        # Where this batch class's acceptance is measured (rounds verified in other buckets),
        # the exploration's drafts save what they are expected to accept: E[T] - 1 tokens a
        # request a step, each off_s / b of off's time at b requests. Unmeasured (a cold
        # engine), none is counted.
        share = self._class_acc[self._greedy]
        accepted_s = 0.0
        if share.trials >= self.ceiling_prior_rounds * self._unit:
            accepted_s = (geometric_tokens(share.hits / share.trials, k) - 1.0) * off_s
        cost_s = self.cost_profile.first_exploration_s(
            top, k, min(self.target_cost.predict(num_decoding), off_s), self._greedy,
            self.explore_len + self.spec_settle_steps, view.unseen_tokens, accepted_s)
        if cost_s is None:
            return 0
        horizon_s = max(view.remaining_tokens * off_s, self._bucket_s.get(bkt, 0.0))
        if cost_s <= self.explore_budget * horizon_s:
            return 0
        need = (cost_s / self.explore_budget - self._bucket_s.get(bkt, 0.0)) / off_s
        return int(min(max(need, self.explore_every), 4 * self.explore_every))

    def _explore(self, k: int, bucket: int, num_decoding: int) -> int:
        """Run ``k`` for the next ``explore_len`` steps (this one included)."""
        self._held.pop(bucket, None)  # the choice after it is made afresh
        if k > 0:
            self._drafted.add(bucket)
        self._explore_k, self._explore_bucket = k, bucket
        if k == 0:
            settle = self.off_settle_steps if self._decided.get(bucket, 0) > 0 else 0
        else:
            settle = self.spec_settle_steps if self.last_k == 0 else 0
        self._explore_left = self.explore_len - 1 + settle
        if self._probe is not None:  # its last reports would be this exploration's steps
            self._end_probe()
        window = self.rates.get((bucket, self._decided.get(bucket, 0)))
        if window is not None and len(window.steps) >= self.min_rate_steps and k != self._decided.get(bucket, 0):
            # Its steps and the one after (which verifies its last drafts) are costed against
            # the k in use; the report that comes next is still the previous step's.
            e = self.expected_accepted(self._decided.get(bucket, 0))
            self._probe = {"bucket": bucket, "rate": window.rate(e), "step_s": window.per_step(e)[1],
                           "skip": 1, "left": self.explore_len + 1, "tokens": 0, "seconds": 0.0}
        return self._set(k, num_decoding)

    def _cost_exploration(self, num_tokens: int, seconds: float) -> None:
        """One reported step of the exploration being costed; after its last, the bucket's
        next exploration waits until the budget covers this one's cost."""
        probe = self._probe
        assert probe is not None
        if probe["skip"]:
            probe["skip"] -= 1
            return
        probe["tokens"] += num_tokens
        probe["seconds"] += seconds
        probe["left"] -= 1
        probe["seen"] = probe.get("seen", 0) + 1
        if probe["left"] == 0:
            self._end_probe()

    def _end_probe(self) -> None:
        """Set the bucket's next exploration interval from the costed steps (scaled up to the
        whole exploration where the next one began before the last were reported)."""
        probe = self._probe
        assert probe is not None
        self._probe = None
        seen = probe.get("seen", 0)
        if seen == 0:
            return
        cost_s = max(probe["seconds"] - probe["tokens"] / probe["rate"], 0.0) * (seen + probe["left"]) / seen
        self._min_interval[probe["bucket"]] = int(cost_s / (self.explore_budget * probe["step_s"]))

    def _model_choice(self, num_decoding: int, cap: int | None = None,
                      measured: dict[int, float] | None = None) -> tuple[int, int]:
        """(the cost model's best k, its best k > 0), k <= cap (default: ``k_cap``);
        ``measured``: the bucket's ``_measured_rates`` when the caller has them.

        Calibrated by what was measured in the bucket: off's rate scaled to off's measured one,
        every k > 0 by the measured/modelled ratio of the k > 0 with the most steps behind it
        (by off's ratio while none is measured). The model leaves out costs that come with
        drafts (the rejection sampler, the drafts' bookkeeping: at batch 4 a k = 2 step took 11
        ms where it modelled 7.6, built-in pair, AVX2), so uncalibrated it sent a cold
        controller to explore k = 2 after k = 1 had measured 0.89x of off, a few percent of a
        short run lost for nothing."""
        cap = self.k_cap(num_decoding) if cap is None else cap
        b = num_decoding
        other = self.step_overhead_s
        t_alpha, t_beta = self.target_cost.params()
        d_alpha, d_beta = self.draft_cost.params()
        draft_step = d_alpha + d_beta * b
        rates = [b / (t_alpha + t_beta * b + other)]
        for k, (tokens, drafts) in enumerate(self._all_round_figures(cap), start=1):
            # The chain runs while any row drafts: one row's own count of forwards, drifting
            # to the cap as the batch grows.
            forwards = drafts + (k - drafts) * (1.0 - 1.0 / b)
            seconds = t_alpha + t_beta * b * (1.0 + drafts) + other + forwards * draft_step
            rates.append(b * tokens / seconds)
        measured = self._measured_rates(b, cap) if measured is None else measured
        scale_off = measured[0] / rates[0] if 0 in measured else 1.0
        scale_on, most = scale_off, 0  # no k measured yet: the model's own comparison
        bkt = self.bucket(b, self._greedy)
        for k, rate in measured.items():
            if k > 0 and len(self.rates[(bkt, k)].steps) > most:
                scale_on, most = rate / rates[k], len(self.rates[(bkt, k)].steps)
        best_k, best_rate = 0, rates[0] * scale_off
        best_pos, best_pos_rate = 1, 0.0
        for k in range(1, cap + 1):
            rate = rates[k] * scale_on
            if rate > best_rate:
                best_k, best_rate = k, rate
            if rate > best_pos_rate:
                best_pos, best_pos_rate = k, rate
        return best_k, best_pos
