"""Observability for a local stack: a Prometheus that scrapes the stack's components with the chart's
recording and alerting rules (docs/observability.md).

    from tilert_serve import observe
    handle = observe.start(state_dir, [observe.local_target(c.kind, c.url) for c in plan.components])
    ...
    observe.stop(handle)
"""

from tilert_serve.observe.config import JOBS, ConfigError, Intervals, Target, local_target
from tilert_serve.observe.server import ObserveError, Prometheus, start, stop

__all__ = [
    "JOBS",
    "ConfigError",
    "Intervals",
    "ObserveError",
    "Prometheus",
    "Target",
    "local_target",
    "start",
    "stop",
]
