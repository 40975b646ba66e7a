"""When each request is meant to leave the client.

Inter-arrival gaps are gamma-distributed with shape = ``burstiness`` and mean
1 / rate (so burstiness 1 is a Poisson process; below 1 burstier, above 1 more even),
as in ``vllm bench serve``. A ramp-up moves the rate from ``ramp[0]`` to ``ramp[1]``
requests/s across the run, as vLLM's ``--ramp-up-strategy``: ``linear`` (request i at
start + (end - start) * i / (n - 1)) or ``exponential`` (start * (end / start) ** (i / (n - 1))).
``rate = inf`` sends everything at t = 0.
"""

from __future__ import annotations

import math

import numpy as np

from tailserve.errors import ConfigError

RAMP_STRATEGIES = ("linear", "exponential")


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0,
                    ramp: tuple[float, float] | None = None, ramp_strategy: str = "linear") -> list[float]:
    """Seconds after the start at which each of ``n`` requests is sent (non-decreasing)."""
    if rate <= 0:
        raise ConfigError("--request-rate must be positive (inf: all at once)")
    if burstiness <= 0:
        raise ConfigError("--burstiness must be positive")
    if ramp is not None and (ramp[0] <= 0 or ramp[1] <= 0 or math.isinf(ramp[0]) or math.isinf(ramp[1])):
        raise ConfigError("--ramp-up-start-rps and --ramp-up-end-rps must be positive and finite")
    if ramp_strategy not in RAMP_STRATEGIES:
        raise ConfigError(f"--ramp-up-strategy must be one of {', '.join(RAMP_STRATEGIES)}")
    if math.isinf(rate) and ramp is None:
        return [0.0] * n
    rng = np.random.default_rng(seed)
    out, t = [], 0.0
    for i in range(n):
        f = i / max(n - 1, 1)
        if ramp is None:
            r = rate
        elif ramp_strategy == "linear":
            r = ramp[0] + (ramp[1] - ramp[0]) * f
        else:
            r = ramp[0] * (ramp[1] / ramp[0]) ** f
        if i:  # the first request leaves at once; the gaps keep their distribution
            t += float(rng.gamma(shape=burstiness, scale=1.0 / (r * burstiness)))
        out.append(t)
    return out


def count_for_duration(duration_s: float, rate: float) -> int:
    """How many requests to prepare so that a run of ``duration_s`` at ``rate`` never runs dry
    (the sender stops at the duration; the rest are not sent)."""
    if math.isinf(rate):
        raise ConfigError("--duration needs a finite --request-rate")
    mean = duration_s * rate
    return int(mean + 6 * math.sqrt(mean) + 10)
