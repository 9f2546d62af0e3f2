"""The Docker engine, through its CLI: the I/O edge of `tilert-pd local up --runtime docker`.

The CLI rather than an SDK: it is what users have, it talks to any engine version (the machines here
run a 20.10 daemon behind a newer client), and it adds no dependency. Every call is bounded in time;
a failing call raises DockerError with the command and the engine's own message.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Label on every container and network the runtime creates: the run's cluster name.
RUN_LABEL = "pd.tilert.ai/local-run"


class DockerError(RuntimeError):
    pass


def _docker(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(
            ["docker", *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError as exc:
        raise DockerError(
            "no `docker` command on PATH; install a Docker engine (scripts/docker-engine.sh does, as root)"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise DockerError(f"`docker {' '.join(args[:2])}` did not answer in {timeout:.0f} s") from exc
    if check and done.returncode != 0:
        raise DockerError(
            f"`docker {' '.join(args[:3])} ...` failed: {done.stderr.strip() or done.stdout.strip()}"
        )
    return done


def unavailable() -> str | None:
    """Why no Docker engine can be used, or None when one answers."""
    if shutil.which("docker") is None:
        return "no `docker` command on PATH"
    try:
        done = _docker("info", "--format", "{{.ServerVersion}}", timeout=20, check=False)
    except DockerError as exc:
        return str(exc)
    if done.returncode != 0:
        return f"the Docker engine does not answer: {done.stderr.strip()}"
    return None


def image_exists(tag: str) -> bool:
    return _docker("image", "inspect", tag, check=False).returncode == 0


@dataclass(frozen=True)
class Network:
    name: str
    subnet: str
    gateway: str


def network_create(name: str, run: str) -> Network:
    """A bridge network the host reaches (it holds the gateway address) but whose containers get no
    route off it (`--internal`: a pod network without egress). Its subnet is the one the engine's
    address pools pick (so it clashes with nothing on the host), written down explicitly because the
    engine gives containers fixed addresses (the pod IPs the downward API reports) only on networks
    with a user-configured subnet."""
    create = ["network", "create", "--driver", "bridge", "--internal", "--label", f"{RUN_LABEL}={run}"]
    _docker(*create, name)
    picked = _ipam(name)
    _docker("network", "rm", name)
    _docker(
        *create, "--subnet", picked.subnet, *(["--gateway", picked.gateway] if picked.gateway else []), name
    )
    return _ipam(name)


def _ipam(name: str) -> Network:
    info = json.loads(_docker("network", "inspect", name).stdout)[0]
    cfg = info["IPAM"]["Config"][0]
    return Network(name, cfg["Subnet"], cfg.get("Gateway", ""))


def network(name: str) -> Network:
    """An existing network's subnet and gateway."""
    return _ipam(name)


def network_used(name: str) -> set[str]:
    """The IPv4 addresses the network's containers hold."""
    info = json.loads(_docker("network", "inspect", name).stdout)[0]
    return {
        c["IPv4Address"].split("/")[0]
        for c in (info.get("Containers") or {}).values()
        if c.get("IPv4Address")
    }


def network_disconnect(network: str, container: str) -> None:
    _docker("network", "disconnect", network, container)


def networks(run: str) -> list[str]:
    out = _docker("network", "ls", "--filter", f"label={RUN_LABEL}={run}", "--format", "{{.Name}}").stdout
    return [n for n in out.split() if n]


def network_rm(names: Sequence[str]) -> None:
    if names:
        _docker("network", "rm", *names, check=False)


@dataclass(frozen=True)
class RunSpec:
    """One container, as `docker create` takes it."""

    name: str
    image: str
    entrypoint: Sequence[str] | None
    args: Sequence[str] | None
    env: Mapping[str, str]
    labels: Mapping[str, str]
    #: (host path, container path, read-only)
    binds: Sequence[tuple[str, str, bool]] = ()
    network: str | None = None
    #: Join another container's network namespace (a pod's second container).
    network_of: str | None = None
    ip: str | None = None
    hostname: str | None = None
    aliases: Sequence[str] = ()
    working_dir: str | None = None
    user: str | None = None
    group_add: Sequence[int] = ()
    cap_add: Sequence[str] = ()
    shm_size: str | None = None


def create_args(spec: RunSpec) -> list[str]:
    """`docker create` arguments for spec (pure; tested on its own)."""
    a = ["create", "--name", spec.name]
    for k, v in spec.labels.items():
        a += ["--label", f"{k}={v}"]
    if spec.network_of:
        a += ["--network", f"container:{spec.network_of}"]
    elif spec.network:
        a += ["--network", spec.network]
        if spec.ip:
            a += ["--ip", spec.ip]
        for alias in spec.aliases:
            a += ["--network-alias", alias]
        if spec.hostname:
            a += ["--hostname", spec.hostname]
    for k, v in spec.env.items():
        a += ["--env", f"{k}={v}"]
    for host, target, ro in spec.binds:
        a += ["--mount", f"type=bind,source={host},target={target}" + (",readonly" if ro else "")]
    if spec.working_dir:
        a += ["--workdir", spec.working_dir]
    if spec.user:
        a += ["--user", spec.user]
    for group in spec.group_add:
        a += ["--group-add", str(group)]
    for cap in spec.cap_add:
        a += ["--cap-add", cap]
    if spec.shm_size:
        a += ["--shm-size", _docker_size(spec.shm_size)]
    args = list(spec.args or [])
    if spec.entrypoint is not None:
        a += ["--entrypoint", spec.entrypoint[0]]
        args = [*spec.entrypoint[1:], *args]
    a.append(spec.image)
    return a + args


def _docker_size(quantity: str) -> str:
    """A Kubernetes memory quantity as Docker writes sizes (Mi -> m, Gi -> g: both binary)."""
    for suffix, unit in (("Ki", "k"), ("Mi", "m"), ("Gi", "g")):
        if quantity.endswith(suffix):
            return quantity[: -len(suffix)] + unit
    return quantity


def network_connect(network: str, container: str, ip: str, aliases: Sequence[str] = ()) -> None:
    _docker(
        "network",
        "connect",
        "--ip",
        ip,
        *[a for alias in aliases for a in ("--alias", alias)],
        network,
        container,
    )


def create(spec: RunSpec) -> None:
    _docker(*create_args(spec))


def start(name: str) -> None:
    _docker("start", name)


def wait(name: str, timeout: float) -> int:
    """Wait for the container to exit; its exit code."""
    return int(_docker("wait", name, timeout=timeout).stdout.strip() or -1)


def inspect(name: str) -> dict[str, Any] | None:
    done = _docker("inspect", name, check=False)
    if done.returncode != 0:
        return None
    data: dict[str, Any] = json.loads(done.stdout)[0]
    return data


def logs(name: str, tail: int | None = None) -> str:
    args = ["logs", *(["--tail", str(tail)] if tail else []), name]
    done = _docker(*args, check=False)
    return done.stdout + done.stderr


def exec_(name: str, argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return _docker("exec", name, *argv, timeout=timeout, check=False)


def containers(run: str, *, running_only: bool = False) -> list[str]:
    status = ["--filter", "status=running"] if running_only else []
    out = _docker(
        "ps", "-a", "--filter", f"label={RUN_LABEL}={run}", *status, "--format", "{{.Names}}"
    ).stdout
    return [n for n in out.split() if n]


def stop(names: Sequence[str], grace_s: float) -> None:
    if names:
        _docker("stop", "--time", str(int(grace_s)), *names, timeout=grace_s + 60, check=False)


def rm(names: Sequence[str]) -> None:
    if names:
        _docker("rm", "--force", "--volumes", *names, timeout=120, check=False)


def _in_netns(name: str, *argv: str) -> str:
    """Run a host tool inside a running container's network namespace (images need no `ip` tool)."""
    info = inspect(name)
    pid = int((info or {}).get("State", {}).get("Pid") or 0)
    if not pid:
        raise DockerError(f"container {name} is not running")
    done = subprocess.run(
        ["nsenter", "-t", str(pid), "-n", *argv], capture_output=True, text=True, timeout=20
    )
    if done.returncode != 0:
        raise DockerError(f"cannot read {name}'s network namespace: {done.stderr.strip()}")
    return done.stdout


def interfaces(name: str) -> list[tuple[str, str]]:
    """(interface, IPv4 address) inside a running container."""
    out = []
    for link in json.loads(_in_netns(name, "ip", "-j", "-4", "addr", "show") or "[]"):
        for addr in link.get("addr_info", []):
            if link["ifname"] != "lo":
                out.append((str(link["ifname"]), str(addr["local"])))
    return out


def received_bytes(name: str) -> dict[str, int]:
    """Bytes each interface of a running container has received (its counters, as `ip -s` shows)."""
    links = json.loads(_in_netns(name, "ip", "-j", "-s", "link", "show") or "[]")
    return {str(link["ifname"]): int(link["stats64"]["rx"]["bytes"]) for link in links}
