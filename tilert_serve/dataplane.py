"""Where a TileRT node's data plane lives: one decision, made the same way by the node (from its own
pod's annotations, mounted by the downward API) and by the operator (from the pod it watches).

With `spec.transfer.rdma.networks` named, the data-plane address is the pod's address on the first
of those networks that Multus reports in the pod's `k8s.v1.cni.cncf.io/network-status` annotation;
there is no fallback to the pod IP (the bytes would silently cross the pod network): a missing entry
is an error with its reason. Without networks it is the pod IP. `choose` is pure; `find` (through
`wait_for`) is the one edge that reads the mounted file, for both ends of the handoff (the decode
node and the prefill's connector).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

#: The pod annotation Multus writes (k8snetworkplumbingwg network-attachment-definition spec, v1.2).
MULTUS_STATUS_ANNOTATION: Final = "k8s.v1.cni.cncf.io/network-status"
#: Where the decode node's pod mounts that annotation (a downwardAPI volume item).
NETWORK_STATUS_FILE: Final = "/etc/tilert-pd/podinfo/network-status"


@dataclass(frozen=True)
class DataPlane:
    """A node's data-plane address, the interface it is on (when known) and where it came from."""

    address: str | None
    interface: str | None
    #: "multus:<namespace/name>", "pod-ip", or "missing".
    source: str
    #: Why the address is missing, with what to do; empty when found.
    problem: str = ""


def _network_matches(entry_name: str, wanted: str, namespace: str) -> bool:
    # Multus reports "namespace/name"; the spec may say "name" (the pod's namespace) or "namespace/name".
    full = wanted if "/" in wanted else f"{namespace}/{wanted}"
    return entry_name in (wanted, full)


def parse_network_status(raw: str | None) -> list[dict[str, Any]]:
    """The annotation's entries; an absent or malformed annotation has none."""
    if not raw:
        return []
    try:
        entries = json.loads(raw)
    except ValueError:
        return []
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def choose(
    networks: Sequence[str], network_status: str | None, namespace: str, pod_ip: str | None
) -> DataPlane:
    """The data-plane address for a pod: see the module docstring."""
    if not networks:
        return DataPlane(pod_ip, None, "pod-ip", "" if pod_ip else "the pod has no IP yet")
    entries = parse_network_status(network_status)
    for wanted in networks:
        for entry in entries:
            if _network_matches(str(entry.get("name", "")), wanted, namespace):
                ips = [str(ip) for ip in entry.get("ips") or []]
                if ips:
                    iface = entry.get("interface")
                    return DataPlane(ips[0], str(iface) if iface else None, f"multus:{entry['name']}")
    names = ", ".join(networks)
    seen = ", ".join(str(e.get("name")) for e in entries) or "none"
    return DataPlane(
        None,
        None,
        "missing",
        f"Multus reports no address on {names} (networks in {MULTUS_STATUS_ANNOTATION}: {seen}); "
        "check the NetworkAttachmentDefinition named in spec.transfer.rdma.networks exists in the "
        "pod's namespace and that Multus attached it (kubectl describe pod)",
    )


def is_ipv6(address: str) -> bool:
    """Whether `address` is an IPv6 literal (a DNS name is not)."""
    try:
        return ipaddress.ip_address(address).version == 6
    except ValueError:
        return False


def url_host(address: str) -> str:
    """An address as a URL's host: IPv6 in brackets."""
    return f"[{address}]" if is_ipv6(address) else address


def http_url(address: str, port: int) -> str:
    return f"http://{url_host(address)}:{port}"


class DataPlaneMissing(Exception):
    """Multus never reported the data-plane network; the message says which and what to check."""


def wait_for(
    networks: Sequence[str], status_file: str | Path, namespace: str, timeout_s: float, sleep_s: float = 1.0
) -> DataPlane:
    """This pod's address on `networks`, read from its mounted network-status file. Multus may write
    the annotation after the container starts (the kubelet refreshes the file within about a minute),
    so wait for it, saying so every 10 s, and raise DataPlaneMissing with the reason if it never comes."""
    path, log = Path(status_file), logging.getLogger(__name__)
    deadline, next_note = time.monotonic() + timeout_s, 0.0
    while True:
        where = choose(networks, path.read_text() if path.exists() else None, namespace, None)
        if where.address is not None:
            log.info(
                "data plane on %s (%s, interface %s)", where.address, where.source, where.interface or "?"
            )
            return where
        now = time.monotonic()
        if now >= deadline:
            raise DataPlaneMissing(
                f"no data-plane address after {timeout_s:.0f} s: {where.problem} (read from {path})"
            )
        if now >= next_note:
            log.info("waiting for Multus to report %s in %s", ", ".join(networks), path)
            next_note = now + 10
        time.sleep(sleep_s)


def find(
    networks: Sequence[str],
    status_file: str | Path,
    namespace: str,
    fallback: str,
    timeout_s: float,
    sleep_s: float = 1.0,
) -> DataPlane:
    """This pod's data-plane address, as both ends of the handoff take it: on `networks` (waiting for
    Multus, see wait_for) when any are named, else `fallback` (the pod IP or the configured host)."""
    if not networks:
        return DataPlane(fallback, None, "pod-ip")
    return wait_for(networks, status_file, namespace, timeout_s, sleep_s)
