"""Latency percentiles: exact for finite result sets, a bounded-error sketch for servers.

Exact percentiles use numpy's default (linear) interpolation, so our P99 is the number a
user gets from ``numpy.percentile`` on the same values.

A long-running server cannot keep every latency, and fixed histogram buckets give a P99
whose error depends on where the buckets happen to fall. ``StreamingQuantiles`` uses
DDSketch (Datadog's maintained ``ddsketch`` package): logarithmic buckets with a
*relative*-error guarantee, |estimate - true| <= alpha * true for every quantile, in memory
that grows with the log of the value range, not with the number of samples. Relative
error is the right guarantee for latency, whose tail spans orders of magnitude. (We chose
it over HdrHistogram because it needs no preset range or precision and merges exactly.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from ddsketch import DDSketch

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0, 99.9)


def percentiles(values: Sequence[float] | np.ndarray, qs: Iterable[float] = DEFAULT_PERCENTILES
                ) -> dict[float, float]:
    """Exact percentiles (numpy's linear interpolation). Empty input gives NaN."""
    arr = np.asarray(values, dtype=np.float64)
    qs = tuple(qs)
    for q in qs:
        if not 0.0 <= q <= 100.0:
            raise ValueError(f"percentile {q} outside [0, 100]")
    if arr.size == 0:
        return {q: float("nan") for q in qs}
    return dict(zip(qs, (float(v) for v in np.percentile(arr, qs))))


class StreamingQuantiles:
    """Streaming quantiles with relative error at most ``relative_accuracy`` (values > 0)."""

    def __init__(self, relative_accuracy: float = 0.01) -> None:
        if not 0.0 < relative_accuracy < 1.0:
            raise ValueError("relative_accuracy must be in (0, 1)")
        self.relative_accuracy = relative_accuracy
        self._sketch = DDSketch(relative_accuracy=relative_accuracy)

    def add(self, value: float) -> None:
        self._sketch.add(value)

    def extend(self, values: Iterable[float]) -> None:
        for v in values:
            self._sketch.add(v)

    def merge(self, other: StreamingQuantiles) -> None:
        self._sketch.merge(other._sketch)

    @property
    def count(self) -> int:
        return int(self._sketch.count)

    def quantile(self, q: float) -> float:
        """q in [0, 1]; NaN when empty."""
        if self._sketch.count == 0:
            return float("nan")
        v = self._sketch.get_quantile_value(q)
        return float("nan") if v is None else float(v)

    def percentiles(self, qs: Iterable[float] = DEFAULT_PERCENTILES) -> dict[float, float]:
        return {q: self.quantile(q / 100.0) for q in qs}
