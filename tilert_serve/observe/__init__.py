"""Observability for a local stack: a Prometheus that scrapes the stack's components with the chart's
recording and alerting rules (docs/observability.md).

    from tilert_serve import observe
    handle = observe.start(state_dir, [observe.Target("router", "127.0.0.1:8000", token_file=keys)])
    ...
    observe.stop(handle)
"""

from tilert_serve.observe.config import JOBS, ConfigError, Intervals, Target
from tilert_serve.observe.server import ObserveError, Prometheus, start, stop

__all__ = ["JOBS", "ConfigError", "Intervals", "ObserveError", "Prometheus", "Target", "start", "stop"]
