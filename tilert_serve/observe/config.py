"""A local stack's Prometheus configuration, as plain data: which components to scrape, with which
credential, and which rule files to evaluate. Pure: nothing here reads a file or starts a process
(`server.py` does).

Each target's `job` is its component's name (`JOBS`), the same value the chart's PodMonitor takes from
the pods' `pd.tilert.ai/component` label, and every target carries `pdcluster`, so the chart's rules
(charts/tilert-pd/files/prometheus-rules.yaml) read a local stack as they read a cluster.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

#: A target's job: the component it is (the operator's names for its pools' components), and the
#: operator's own, named apart: "operator" alone is too common a job name to alert on.
JOBS: Final = ("router", "tilert-decode", "prefill", "native-decode", "tilert-pd-operator")
#: The `pdcluster` label of a local stack's series.
LOCAL_CLUSTER: Final = "local"


class ConfigError(ValueError):
    """A target list Prometheus could not be configured from; the message says what to change."""


@dataclass(frozen=True)
class Target:
    """One component's metrics endpoint."""

    job: str
    #: host:port, e.g. 127.0.0.1:8000.
    address: str
    #: A file whose first token goes in `Authorization: Bearer` (the router's API keys file, one key
    #: a line); None: the endpoint's /metrics is open (a decode node's, vLLM's).
    token_file: Path | None = None
    path: str = "/metrics"
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.job not in JOBS:
            raise ConfigError(f"target {self.address}: job {self.job!r} is not one of {', '.join(JOBS)}")
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"target address {self.address!r}: give host:port, e.g. 127.0.0.1:8000")
        if not self.path.startswith("/"):
            raise ConfigError(f"target {self.address}: metrics path {self.path!r} must start with /")


#: `tilert-pd local`'s component kinds (tilert_serve.local.plan.Component.kind: the operator's component
#: names, which are the jobs; the short names too) -> the job.
LOCAL_KINDS: Final = {
    **{job: job for job in ("router", "tilert-decode", "prefill", "native-decode")},
    "tilert": "tilert-decode",
    "native": "native-decode",
}


def local_target(kind: str, url: str, token_file: Path | None = None) -> Target:
    """The target of a local stack's component from its kind and base URL (http://host:port)."""
    if kind not in LOCAL_KINDS:
        raise ConfigError(f"component kind {kind!r} is not one of {', '.join(LOCAL_KINDS)}")
    scheme, sep, rest = url.partition("://")
    if scheme != "http" or not sep:
        raise ConfigError(f"component URL {url!r}: give http://host:port")
    return Target(LOCAL_KINDS[kind], rest.rstrip("/"), token_file=token_file)


@dataclass(frozen=True)
class Intervals:
    """How often Prometheus scrapes and evaluates rules. Short ones suit a test or a demo; the
    rules' 5-minute rates need at least two scrapes in their window."""

    scrape_s: float = 5.0
    evaluation_s: float = 5.0

    def __post_init__(self) -> None:
        for name, value in (("scrape_s", self.scrape_s), ("evaluation_s", self.evaluation_s)):
            if not 0.1 <= value <= 300:
                raise ConfigError(f"{name}={value:g}: give 0.1 to 300 seconds")


DEFAULT_INTERVALS: Final = Intervals()


def duration(seconds: float) -> str:
    """A Prometheus duration (integer milliseconds: it takes no fractions)."""
    return f"{max(1, round(seconds * 1000))}ms"


def render(
    targets: Sequence[Target],
    token_files: Mapping[str, Path],
    rule_files: Sequence[Path],
    intervals: Intervals = DEFAULT_INTERVALS,
    cluster: str = LOCAL_CLUSTER,
) -> dict[str, Any]:
    """prometheus.yml as a dict: one scrape config per job. `token_files` maps a job to the file
    Prometheus reads its bearer token from (one token, prepared by the caller)."""
    if not targets:
        raise ConfigError("no targets: name at least one component's metrics endpoint")
    jobs: dict[str, list[Target]] = {}
    for t in targets:
        jobs.setdefault(t.job, []).append(t)
    scrape_configs: list[dict[str, Any]] = []
    for job, members in jobs.items():
        creds = {t.token_file for t in members}
        paths = {t.path for t in members}
        if len(creds) > 1 or len(paths) > 1:
            raise ConfigError(
                f"job {job}: its targets differ in token file or metrics path; give every {job} target "
                "the same ones (Prometheus scrapes a job with one credential and one path)"
            )
        if members[0].token_file is not None and job not in token_files:
            raise ConfigError(f"job {job}: no prepared token file for its credential")
        sc: dict[str, Any] = {
            "job_name": job,
            "metrics_path": members[0].path,
            "static_configs": [
                {"targets": [t.address], "labels": {"pdcluster": cluster, **t.labels}} for t in members
            ],
        }
        if job in token_files:
            sc["authorization"] = {"type": "Bearer", "credentials_file": str(token_files[job])}
        scrape_configs.append(sc)
    return {
        "global": {
            "scrape_interval": duration(intervals.scrape_s),
            "scrape_timeout": duration(min(intervals.scrape_s, 10.0)),
            "evaluation_interval": duration(intervals.evaluation_s),
        },
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": scrape_configs,
    }


def web_config(username: str, password_hash: str) -> dict[str, Any]:
    """Prometheus' --web.config.file: basic auth on every endpoint of its HTTP server (the UI and the
    API), so the local Prometheus, like every port of the stack, checks a credential."""
    return {"basic_auth_users": {username: password_hash}}
