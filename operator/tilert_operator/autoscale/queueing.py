"""Queueing formulas the planner sizes pools with and the simulator (bench/autoscale) serves load by:
Erlang B for a pool of slots without a queue (TileRT: a request that finds every slot busy
overflows), Erlang C and the M/M/c wait for pools that queue (prefill, native). Pure."""

from __future__ import annotations

import math


def erlang_b(servers: int, load: float) -> float:
    """The share of arrivals that find every one of `servers` busy at `load` erlangs (M/M/c/c)."""
    if servers <= 0:
        return 1.0
    b = 1.0
    for k in range(1, servers + 1):
        b = load * b / (k + load * b)
    return b


def erlang_c(servers: int, load: float) -> float:
    """The share of arrivals that wait in an M/M/c queue at `load` erlangs."""
    if servers <= 0 or load >= servers:
        return 1.0
    b = erlang_b(servers, load)
    return servers * b / (servers - load * (1 - b))


def wait_quantile(servers: int, rate: float, service_s: float, p: float) -> float:
    """The p-quantile of an M/M/c queue's wait: P(W > t) = C exp(-(c mu - lambda) t)."""
    if rate <= 0 or service_s <= 0:
        return 0.0
    slack = servers / service_s - rate
    if slack <= 0:
        return math.inf
    c = erlang_c(servers, rate * service_s)
    return math.log(c / (1 - p)) / slack if c > 1 - p else 0.0
