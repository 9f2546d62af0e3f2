"""An emulated cluster network from Linux network namespaces: each pod is a namespace, each network is
a veth pair (two members) or a bridge in a namespace of its own (more), and a pod's interfaces carry
the names Kubernetes gives them (eth0 on the pod network, net1.. for Multus networks).

Nothing here touches the machine's own interfaces: links are created directly inside the namespaces
(never in the root namespace, so a crash leaves no stray link there), no namespace gets a route to
anything but its own subnets, and deleting a namespace deletes its links. Every namespace name starts
with `PREFIX<pid>-`, so a later session can tell a crashed run's leftovers from a live run's.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tilert_serve.local import runner

PREFIX = "tilertpd-"
_LEFTOVER = re.compile(rf"^{PREFIX}(\d+)-")
IP = "/usr/sbin/ip" if Path("/usr/sbin/ip").exists() else "ip"


def sh(*argv: str, timeout: float = 20, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=check)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return sh(IP, *args, check=check)


def namespaces() -> list[str]:
    out = ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def delete_namespaces(names: Sequence[str]) -> list[str]:
    """Deletes the namespaces; returns those that would not go."""
    left = []
    for name in names:
        if ip("netns", "del", name, check=False).returncode != 0 and name in namespaces():
            left.append(name)
    return left


def crashed_leftovers() -> list[str]:
    """Namespaces of ours whose creating test process is gone."""
    return [n for n in namespaces() if (m := _LEFTOVER.match(n)) and not runner.alive(int(m.group(1)))]


def unavailable_reason() -> str | None:
    """Why the test bed cannot run here, or None."""
    if os.geteuid() != 0:
        return f"network-namespace test bed needs root (ip netns add), running as uid {os.geteuid()}"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        res = ip("netns", "add", probe, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run `ip netns add`: {exc}"
    if res.returncode != 0:
        return f"kernel or sandbox refuses network namespaces (`ip netns add` said: {res.stderr.strip()})"
    try:
        veth = ip(
            "-n", probe, "link", "add", "vprobe0", "type", "veth", "peer", "name", "vprobe1", check=False
        )
        if veth.returncode != 0:
            return f"no veth support in the kernel: {veth.stderr.strip()}"
    finally:
        delete_namespaces([probe])
    return None


@dataclass(frozen=True)
class Iface:
    pod: str
    name: str
    mac: str
    ips: tuple[str, ...]


@dataclass
class Pod:
    name: str
    ns: str
    ifaces: dict[str, Iface] = field(default_factory=dict)

    def ip(self, iface: str, version: int = 4) -> str:
        return next(a for a in self.ifaces[iface].ips if ipaddress.ip_address(a).version == version)

    def counters(self) -> dict[str, dict[str, int]]:
        """{iface: {rx_bytes, tx_bytes}} read from /sys inside the namespace (ip netns exec remounts it)."""
        names = list(self.ifaces)
        script = ";".join(
            f"cat /sys/class/net/{i}/statistics/rx_bytes /sys/class/net/{i}/statistics/tx_bytes"
            for i in names
        )
        vals = [int(v) for v in exec_in(self.ns, "sh", "-c", script).stdout.split()]
        return {i: {"rx_bytes": vals[2 * k], "tx_bytes": vals[2 * k + 1]} for k, i in enumerate(names)}

    def listeners(self) -> list[tuple[str, int, str]]:
        """(local address, port, process) of every listening TCP socket in the namespace."""
        out = exec_in(self.ns, "ss", "-ltnpH").stdout
        found = []
        for line in out.splitlines():
            cols = line.split()
            if len(cols) < 4:
                continue
            addr, _, port = cols[3].rpartition(":")
            found.append((addr.strip("[]").split("%")[0], int(port), " ".join(cols[5:])))
        return found


def exec_in(ns: str, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return sh(IP, "netns", "exec", ns, *argv, timeout=timeout)


class Bed:
    """Pods and networks of one test; `close()` removes all of it."""

    def __init__(self, tag: str) -> None:
        self.prefix = f"{PREFIX}{os.getpid()}-{tag}-"
        self.pods: dict[str, Pod] = {}
        self._namespaces: list[str] = []
        self._links = 0

    def _netns(self, name: str) -> str:
        ns = self.prefix + name
        self._namespaces.append(ns)  # recorded before creation: a half-made namespace is still removed
        ip("netns", "add", ns)
        ip("-n", ns, "link", "set", "lo", "up")
        for knob in ("accept_ra=0", "autoconf=0", "router_solicitations=0"):
            # Keep IPv6 housekeeping off the counters (the bytes a test measures are its own).
            with contextlib.suppress(subprocess.CalledProcessError):
                exec_in(ns, "sysctl", "-qw", f"net.ipv6.conf.default.{knob}")
        return ns

    def pod(self, name: str) -> Pod:
        if name not in self.pods:
            self.pods[name] = Pod(name, self._netns(name))
        return self.pods[name]

    def network(self, name: str, members: dict[str, str], subnets: Sequence[str]) -> None:
        """Joins `members` ({pod: interface name}) on one L2 network with addresses from each subnet
        (the i-th member gets host i+1); a bridge namespace of its own beyond two members."""
        nets = [ipaddress.ip_network(s) for s in subnets]
        pods = [(self.pod(p), ifname) for p, ifname in members.items()]
        if len(pods) == 2:
            (a, ia), (b, ib) = pods
            ip("-n", a.ns, "link", "add", ia, "type", "veth", "peer", "name", ib, "netns", b.ns)
        else:
            br_ns = self._netns(f"br-{name}")
            ip("-n", br_ns, "link", "add", "br0", "type", "bridge")
            ip("-n", br_ns, "link", "set", "br0", "up")
            for k, (p, ifname) in enumerate(pods):
                port = f"p{k}"
                ip("-n", p.ns, "link", "add", ifname, "type", "veth", "peer", "name", port, "netns", br_ns)
                ip("-n", br_ns, "link", "set", port, "master", "br0")
                ip("-n", br_ns, "link", "set", port, "up")
        for k, (p, ifname) in enumerate(pods):
            addrs = []
            for net in nets:
                host = net[k + 1]
                if net.version == 6:
                    exec_in(p.ns, "sysctl", "-qw", f"net.ipv6.conf.{ifname}.accept_ra=0")
                    ip("-n", p.ns, "-6", "addr", "add", f"{host}/{net.prefixlen}", "dev", ifname, "nodad")
                else:
                    ip("-n", p.ns, "addr", "add", f"{host}/{net.prefixlen}", "dev", ifname)
                addrs.append(str(host))
            ip("-n", p.ns, "link", "set", ifname, "up")
            mac = exec_in(p.ns, "cat", f"/sys/class/net/{ifname}/address").stdout.strip()
            p.ifaces[ifname] = Iface(p.name, ifname, mac, tuple(addrs))

    def close(self) -> list[str]:
        return delete_namespaces(list(reversed(self._namespaces)))


# -- processes inside pods ------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # A crashed pytest must not leave servers behind in namespaces it can no longer delete. PDEATHSIG
    # survives `ip netns exec`'s exec into the real command.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    os.setsid()


class PodProcess:
    """A command inside a pod's namespace, its output in a log file, killed (its whole group) on stop."""

    def __init__(self, pod: Pod, name: str, argv: Sequence[str], env: dict[str, str], log_dir: Path) -> None:
        self.pod, self.name = pod, name
        self.log = log_dir / f"{name}.log"
        self._fh = self.log.open("wb")
        self.popen = subprocess.Popen(
            [IP, "netns", "exec", pod.ns, *argv],
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_die_with_parent,
        )

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            if self.wait_exit(10) is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        self._fh.close()


def http(
    pod: Pod,
    method: str,
    url: str,
    body: object = None,
    timeout: float = 60,
    headers: dict[str, str] | None = None,
) -> tuple[int, str]:
    """An HTTP request made from inside `pod` (the test process lives in the root namespace, which has
    no route into the bed). Returns (status, body text); status 0 when nothing answered."""
    code = (
        "import json,sys,urllib.request,urllib.error\n"
        "a=json.loads(sys.argv[1])\n"
        "data=None if a['body'] is None else json.dumps(a['body']).encode()\n"
        "req=urllib.request.Request(a['url'],data=data,method=a['method'],"
        "headers={'Content-Type':'application/json',**a['headers']})\n"
        "try:\n"
        " r=urllib.request.urlopen(req,timeout=a['timeout']);print(r.status);print(r.read().decode())\n"
        "except urllib.error.HTTPError as e:\n"
        " print(e.code);print(e.read().decode())\n"
        "except OSError as e:\n"
        " print(0);print(repr(e))\n"
    )
    args = json.dumps(
        {"method": method, "url": url, "body": body, "timeout": timeout, "headers": headers or {}}
    )
    out = exec_in(pod.ns, sys.executable, "-I", "-c", code, args, timeout=timeout + 15).stdout
    status, _, text = out.partition("\n")
    return int(status), text


def wait_http(pod: Pod, url: str, timeout: float, proc: PodProcess | None = None) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
        status, last = http(pod, "GET", url, timeout=3)
        if status == 200:
            return
        time.sleep(0.5)
    raise RuntimeError(
        f"{url} not ready after {timeout} s ({last[:300]})" + (f":\n{proc.tail()}" if proc else "")
    )
