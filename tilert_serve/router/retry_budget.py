"""The retry budget: retries may be at most a fraction of the requests that arrived recently.

The rule (Finagle's and Envoy's retry budgets): over a sliding window of `window_s`, a retry may be
sent while retries so far < `min_retries` + `ratio` x requests. Without it, a pool where every attempt
fails receives (1 + policy.retries) times the load exactly when it can least take it; with it, the
extra load is at most `ratio` (20 % by default) plus a small floor, so a quiet router still retries
a single failure. A per-request limit (policy.retries) alone cannot bound that: it bounds one request,
not a broken pool's total.

Owned by the router's state; every call happens on the event loop, so no lock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class RetryBudget:
    ratio: float
    min_retries: int
    window_s: float
    _requests: deque[float] = field(default_factory=deque)
    _retries: deque[float] = field(default_factory=deque)

    def _prune(self, now: float) -> None:
        horizon = now - self.window_s
        for q in (self._requests, self._retries):
            while q and q[0] <= horizon:
                q.popleft()

    def request(self, now: float) -> None:
        """A request arrived (each client request once, however often it is retried)."""
        self._prune(now)
        self._requests.append(now)

    def allowed(self, now: float) -> float:
        """Retries the window allows now, in all."""
        self._prune(now)
        return self.min_retries + self.ratio * len(self._requests)

    def try_retry(self, now: float) -> bool:
        """Spend one retry if the budget has one; False = the request fails with what it has."""
        allowed = self.allowed(now)  # prunes the window first
        if len(self._retries) + 1 > allowed:
            return False
        self._retries.append(now)
        return True

    def snapshot(self, now: float) -> dict[str, float]:
        allowed = self.allowed(now)
        return {
            "window_s": self.window_s,
            "requests": len(self._requests),
            "retries": len(self._retries),
            "allowed": allowed,
        }
