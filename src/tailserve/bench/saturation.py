"""Over-saturation: a load level the server cannot keep up with, told apart from a slow one.

Past its capacity a server's queue grows for as long as requests keep coming: the requests in
flight and the time to first token both rise without bound, and every figure the level
reports depends on how long it ran. GuideLLM's idea is to test for that growth; the test here:

- the window is the newest half of the run so far (at least ``MIN_WINDOW_S`` seconds);
- over it, ordinary least-squares slopes of TTFT against the time the first token came (one
  point per request that has it) and of in-flight requests against time (sampled every 0.1 s);
- over-saturated when both slopes are positive with a t-statistic (slope / its standard
  error) of at least ``T_MIN``, and the growth is material: the fitted TTFT rises by at least
  half its window median and in-flight requests by at least ``MIN_CONCURRENCY_RISE`` across
  the window. A server that is merely slow has a high TTFT that does not trend, and a
  burst that drains has a slope that turns.

The bench applies it live under ``--stop-on-oversaturation`` (the level stops sending and says
when) and, either way, to the finished level's records up to its last send (the drain after
it is not load; ``saturation`` in the result JSON).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MIN_WINDOW_S = 5.0
MIN_POINTS = 10
T_MIN = 3.0
MIN_CONCURRENCY_RISE = 2.0
SAMPLE_S = 0.1


@dataclass(frozen=True)
class SaturationVerdict:
    oversaturated: bool
    window_s: float  # the window the slopes were fitted over (0: too short to test)
    ttft_slope_ms_per_s: float | None
    concurrency_slope_per_s: float | None
    at_s: float | None = None  # when a live test fired (the level stopped sending then)

    def to_dict(self) -> dict[str, object]:
        return {"oversaturated": self.oversaturated, "at_s": self.at_s, "window_s": self.window_s,
                "ttft_slope_ms_per_s": self.ttft_slope_ms_per_s,
                "concurrency_slope_per_s": self.concurrency_slope_per_s,
                "test": f"OLS slopes of TTFT and in-flight requests over the newest half of the run, both with "
                        f"t >= {T_MIN:g} and a rise of >= 50% of the median TTFT and >= "
                        f"{MIN_CONCURRENCY_RISE:g} requests"}


def _slope(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """OLS slope and its t-statistic (inf for a perfect positive fit)."""
    xc = x - x.mean()
    sxx = float(xc @ xc)
    if sxx <= 0:
        return 0.0, 0.0
    b = float(xc @ (y - y.mean())) / sxx
    resid = y - y.mean() - b * xc
    dof = max(len(x) - 2, 1)
    se = float(np.sqrt(float(resid @ resid) / dof / sxx))
    return b, (b / se if se > 0 else (np.inf if b > 0 else 0.0))


def in_flight(starts: Sequence[float], ends: Sequence[float | None], until_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Requests in flight every ``SAMPLE_S`` seconds up to ``until_s`` (an end of None: still open)."""
    t = np.arange(0.0, until_s, SAMPLE_S)
    s = np.sort(np.asarray(starts, dtype=float))
    e = np.sort(np.asarray([until_s + 1.0 if x is None else x for x in ends], dtype=float))
    return t, np.searchsorted(s, t, side="right") - np.searchsorted(e, t, side="right")


def check_oversaturation(ttft_points: Sequence[tuple[float, float]], conc_t: np.ndarray, conc: np.ndarray,
                         now_s: float, min_window_s: float = MIN_WINDOW_S) -> SaturationVerdict:
    """``ttft_points``: (first-token time, TTFT) in seconds (by when the first token came, so
    a queue whose newest requests have none yet still shows); ``conc_t``/``conc``: in-flight
    samples."""
    window = max(now_s / 2, min_window_s)
    lo = now_s - window
    pts = np.asarray([p for p in ttft_points if p[0] >= lo], dtype=float).reshape(-1, 2)
    keep = conc_t >= lo
    if now_s < 2 * min_window_s or len(pts) < MIN_POINTS or keep.sum() < MIN_POINTS:
        return SaturationVerdict(False, 0.0, None, None)
    b_ttft, t_ttft = _slope(pts[:, 0], pts[:, 1])
    b_conc, t_conc = _slope(conc_t[keep].astype(float), conc[keep].astype(float))
    median_ttft = float(np.median(pts[:, 1]))
    over = (t_ttft >= T_MIN and t_conc >= T_MIN and b_ttft * window >= 0.5 * median_ttft
            and b_conc * window >= MIN_CONCURRENCY_RISE)
    return SaturationVerdict(bool(over), window, b_ttft * 1e3, b_conc)
