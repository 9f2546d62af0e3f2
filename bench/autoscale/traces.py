"""Load traces: request arrival rates per interval, seeded, pure.

Each trace is a list of mean rates (requests/s) per interval; `arrivals` draws the realized rate of
each interval as Poisson counts over the interval, so every strategy sees the same requests.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

#: The traces, by name: (mean rate, intervals, interval seconds, seed) -> rates.
Trace = Callable[[float, int, float, int], list[float]]


def steady(mean: float, n: int, dt: float, seed: int) -> list[float]:
    return [mean] * n


def diurnal(mean: float, n: int, dt: float, seed: int) -> list[float]:
    """One day compressed into the run: a sine from 0.3x to 1.7x of the mean, the trough first."""
    return [mean * (1.0 - 0.7 * math.cos(2 * math.pi * i / n)) for i in range(n)]


#: The spike's height over the base rate, and where it sits in the run (fractions of it).
SPIKE_X = 5.0
SPIKE_AT = (0.4, 0.55)


def spike(mean: float, n: int, dt: float, seed: int) -> list[float]:
    """A base rate with a 5x plateau for 15 % of the run; `mean` is the whole run's mean."""
    lo, hi = int(SPIKE_AT[0] * n), int(SPIKE_AT[1] * n)
    width = (hi - lo) / n
    base = mean / (1 - width + SPIKE_X * width)
    return [base * (SPIKE_X if lo <= i < hi else 1.0) for i in range(n)]


#: Bursty: a two-state Markov chain (calm 0.5x, burst 2.5x of the base), mean dwell in seconds.
BURST_X = (0.5, 2.5)
BURST_DWELL_S = (600.0, 180.0)


def bursty(mean: float, n: int, dt: float, seed: int) -> list[float]:
    """Calm and burst states with exponential dwell times; scaled so the trace's mean is `mean`."""
    rng = random.Random(seed)
    state, out = 0, []
    for _ in range(n):
        out.append(BURST_X[state])
        if rng.random() < 1 - math.exp(-dt / BURST_DWELL_S[state]):
            state = 1 - state
    scale = mean / (sum(out) / len(out))
    return [r * scale for r in out]


TRACES: dict[str, Trace] = {"steady": steady, "diurnal": diurnal, "5x spike": spike, "bursty": bursty}


def poisson(rng: random.Random, lam: float) -> int:
    """A Poisson count (Knuth's product method below 30, a rounded normal above: exact enough here)."""
    if lam <= 0:
        return 0
    if lam > 30:
        return max(0, round(rng.gauss(lam, math.sqrt(lam))))
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def arrivals(rates: list[float], dt: float, seed: int) -> list[float]:
    """The realized rate of each interval: Poisson(rate x dt) / dt."""
    rng = random.Random(seed + 1)
    return [poisson(rng, r * dt) / dt for r in rates]
