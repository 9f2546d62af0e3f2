"""The full local stack (`tilert-pd local up`'s launch: the tiny generated model, vLLM's CPU prefill with
the TileRTConnector and MTP, a TileRT decode node on the reference engine, the router with its handoff
probes) with HandoffReady computed exactly as the operator computes it (tilert_operator.handoff reads
each node's authenticated GET /v1/status, tilert_operator.status turns the reports into the condition),
and three faults with their repairs. Shared by tests/local/test_local_handoff_ready.py
and bench/operator/handoff_ready.py.

The faults, each as a real cluster meets it:

- secret: the node's copy of the handoff secret differs from the prefill's. In a cluster each pod mounts
  the `<cluster>-handoff` Secret on its own; here the node gets its own copy of the state directory's
  secret file (in a directory of its own: FileKeyring also reads an `accept` file beside it), rewritten
  to another value (the fault) and back (the repair). Both sides re-read their file on change. A wrong
  MAC is anyone's to send, so the node records no failure for it; vLLM's sender runs after the prefill
  answered, so the probe's ticket expires unused: a Timeout, whose message counts the failed
  authentications and names the secret.
- unreachable: the node's process group is stopped (SIGSTOP) and resumed (SIGCONT). Every peer (the
  prefill's sender on the ctrl port, the router, the operator's status read) then meets what a network
  partition that drops packets or a hung host gives: connections that nobody answers, i.e. timeouts, while
  the pod itself is still there. (A killed node would refuse connections instead; Kubernetes already
  shows that as an unready pod, so it is not the case HandoffReady exists for.)
- ctrl_blocked (needs root and iptables; the benchmark only): packets to the node's ctrl port dropped on
  loopback (an iptables rule, as a NetworkPolicy or a firewall between the pools would): the router and
  the operator still reach the node's HTTP API, only the prefill's sender cannot open the handoff. vLLM's
  sender runs after the prefill answered, so nobody tells the node: its ticket expires and it records a
  timeout (the netns test bed shows the same). The repair deletes the rule.
- layout: the node restarted on the same ports with another KV-cache dtype than the prefill's (bfloat16
  against the spec's float32), as after a half-finished rollout of a model config; the repair restarts it
  with the rendered command again.
"""

from __future__ import annotations

import asyncio
import base64
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from tilert_operator import constants, observe, status, validation
from tilert_operator import handoff as handoff_check
from tilert_operator.spec import PDClusterSpec
from tilert_serve.local import cli as local_cli
from tilert_serve.local import plan as planmod
from tilert_serve.local import runner

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-cpu.yaml"
#: The router's handoff probes at a test's pace (the operator renders 30 s; retry after a failure 5 s).
PROBE_INTERVAL_S = 2.0
PROBE_RETRY_S = 1.0
#: What each fault turns HandoffReady's reason into.
EXPECTED = {
    "secret": "Timeout",
    "unreachable": "Unreachable",
    "layout": "LayoutMismatch",
    "ctrl_blocked": "Timeout",
}
WRONG_KV_DTYPE = "bfloat16"
#: The node's ticket TTL at a test's pace (the rendered default is 30 s), as the probe interval above: a
#: probe whose state never comes (its sender failed to authenticate, so the node cannot tie the failure
#: to the ticket) holds the router's next probe until the ticket expires, which the secret repair waited
#: out, and a node stopped for the layout fault's restarts drains until its admitted tickets are used or
#: expired (it was SIGKILLed at runner.stop's 15 s grace instead).
TICKET_TTL_S = 8.0


def ctrl_blocking_unavailable() -> str | None:
    """Why the ctrl_blocked fault cannot run here, or None."""
    if os.geteuid() != 0:
        return "dropping packets needs root"
    if shutil.which("iptables") is None:
        return "no iptables"
    return None


def spec_doc() -> dict[str, Any]:
    """examples/tiny-cpu.yaml with one TileRT node and no native pool: the stack HandoffReady is about,
    light enough for two cores."""
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["decode"]["tilert"]["replicas"] = 1
    doc["spec"]["decode"]["native"]["replicas"] = 0
    return doc


def _set_arg(argv: list[str], flag: str, value: str) -> list[str]:
    i = argv.index(flag)
    return [*argv[: i + 1], value, *argv[i + 2 :]]


@dataclass
class Stack:
    local: local_cli.LocalStack
    node_secret: Path
    node: planmod.Component
    blocked: bool = False

    @property
    def spec(self) -> PDClusterSpec:
        return self.local.spec

    def proc(self, name: str) -> runner.Running:
        return next(p for p in self.local.procs if p.name == name)

    def handoff_ready(self) -> tuple[dict[str, Any], list[observe.NodeReport]]:
        """HandoffReady as the operator's reconcile computes it (reconcile.py): the nodes' reports, read
        with the cluster's node-API token, through status.handoff_ready."""
        nodes = self.local.plan.router_config.tilert
        token = self.local.token_file.read_bytes()
        secret = {"data": {constants.NODE_API_TOKEN_KEY: base64.b64encode(token).decode()}}
        reports = asyncio.run(handoff_check.poll(nodes, secret))
        return status.handoff_ready(self.spec.decode.tilert.replicas, nodes, reports), reports

    def ready(self) -> dict[str, Any]:
        """Ready as the operator computes it from the same reports (every pool's pods taken as ready)."""
        cond, reports = self.handoff_ready()
        pools = {c: observe.PoolState(1, 1) for c in (constants.PREFILL, constants.ROUTER)}
        pools[constants.TILERT] = observe.PoolState(1, 1)
        pools[constants.NATIVE] = observe.PoolState(0, 0)
        conds = status.conditions(
            self.local.name,
            pools,
            self.local.plan.router_config.tilert,
            handoff=cond,
            handoff_working=status.any_handoff_working(reports),
        )
        return next(c for c in conds if c["type"] == "Ready")

    def until(
        self,
        what: str,
        pred: Callable[[dict[str, Any]], bool],
        timeout: float = 240.0,
        interval: float = 0.25,
    ) -> tuple[dict[str, Any], float]:
        """Poll HandoffReady until `pred` holds; (the condition, seconds waited). Raises with the last
        condition and the logs' tails when `timeout` passes (a deadline for a hung stack, not a bound)."""
        t0 = time.monotonic()
        last: dict[str, Any] = {}
        while time.monotonic() - t0 < timeout:
            last, _ = self.handoff_ready()
            if pred(last):
                return last, time.monotonic() - t0
            time.sleep(interval)
        raise AssertionError(f"timed out waiting for HandoffReady {what}; last {last}\n{self.logs()}")

    def until_true(self, timeout: float = 240.0) -> tuple[dict[str, Any], float]:
        return self.until("True", lambda c: c["status"] == "True", timeout)

    def until_false(self, reason: str, timeout: float = 240.0) -> tuple[dict[str, Any], float]:
        return self.until(
            f"False/{reason}", lambda c: c["status"] == "False" and c["reason"] == reason, timeout
        )

    def logs(self, lines: int = 25) -> str:
        return "\n".join(f"--- {p.name} ({p.log})\n{runner.tail(p.log, lines)}" for p in self.local.procs)

    # -- faults and repairs ------------------------------------------------------------------------------

    def rotate_node_secret(self, value: str | None = None) -> None:
        runner.write_secret_file(self.node_secret, value or secrets.token_hex(32))

    def restore_node_secret(self) -> None:
        runner.write_secret_file(self.node_secret, self.local.secret_file.read_text())

    def stop_node(self) -> None:
        os.killpg(self.proc(self.node.name).pid, signal.SIGSTOP)

    def resume_node(self) -> None:
        os.killpg(self.proc(self.node.name).pid, signal.SIGCONT)

    def restart_node(self, kv_cache_dtype: str | None = None) -> None:
        """The node again on its ports, from the rendered command or with another KV-cache dtype."""
        old = self.proc(self.node.name)
        runner.stop([old])
        c = self.node
        if kv_cache_dtype is not None:
            c = replace(c, argv=_set_arg(c.argv, "--kv-cache-dtype", kv_cache_dtype))
        new = runner.start(c, self.local.state_dir)
        self.local.procs[self.local.procs.index(old)] = new
        runner.save(
            self.local.state_dir, {"cluster": self.local.name, "router": self.local.router}, self.local.procs
        )
        runner.wait_ready([new], 120, lambda _msg: None)

    def _ctrl_rule(self, op: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [
                "iptables",
                "-w",
                op,
                "INPUT",
                "-i",
                "lo",
                "-p",
                "tcp",
                "--dport",
                str(self.node.ctrl_port),
                "-m",
                "comment",
                "--comment",
                "tilert-pd-handoff-ready",
                "-j",
                "DROP",
            ],
            capture_output=True,
            check=False,
        )

    def block_ctrl(self) -> None:
        done = self._ctrl_rule("-I")
        assert done.returncode == 0, done.stderr.decode()
        self.blocked = True

    def unblock_ctrl(self) -> None:
        while self._ctrl_rule("-D").returncode == 0:
            pass
        self.blocked = False

    def inject(self, fault: str) -> None:
        {
            "secret": self.rotate_node_secret,
            "unreachable": self.stop_node,
            "ctrl_blocked": self.block_ctrl,
            "layout": lambda: self.restart_node(WRONG_KV_DTYPE),
        }[fault]()

    def repair(self, fault: str) -> None:
        {
            "secret": self.restore_node_secret,
            "unreachable": self.resume_node,
            "ctrl_blocked": self.unblock_ctrl,
            "layout": self.restart_node,
        }[fault]()

    def stop(self) -> None:
        if self.blocked:
            self.unblock_ctrl()
        for p in self.local.procs:  # a stopped group would sit out SIGTERM's grace period
            if runner.ours(p):
                try:
                    os.killpg(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        runner.stop(self.local.procs, grace_s=5.0)


def start(
    home: Path,
    *,
    router_port: int | None = None,
    say: Callable[[str], None] = lambda _m: None,
    timeout: float = 600.0,
    ticket_ttl_s: float | None = None,
) -> Stack:
    """The local stack as `tilert-pd local up` starts it (cli.launch), with the router's handoff probes
    at PROBE_INTERVAL_S and the node reading its own copy of the handoff secret; `ticket_ttl_s` sets the
    node's --ticket-ttl (else the rendered default)."""
    doc = spec_doc()
    name = str(doc["metadata"]["name"])
    spec, problems = validation.validate(doc["spec"], name)
    assert spec is not None and not problems, problems
    state_dir = (home / name).resolve()
    node_secret_dir = state_dir / "node-secret"
    node_secret_dir.mkdir(parents=True, exist_ok=True)
    node_secret = node_secret_dir / runner.HANDOFF_SECRET_FILE

    def adjust(p: planmod.Plan) -> planmod.Plan:
        probes = p.router_config.handoff_probe.model_copy(
            update={"interval_s": PROBE_INTERVAL_S, "retry_s": PROBE_RETRY_S}
        )
        comps = []
        for c in p.components:
            if c.kind == constants.TILERT:
                secret_file = Path(c.argv[c.argv.index("--secret-file") + 1])
                runner.write_secret_file(node_secret, secret_file.read_text())
                c = replace(c, argv=_set_arg(c.argv, "--secret-file", str(node_secret)))
                if ticket_ttl_s is not None:
                    c = replace(c, argv=[*c.argv, "--ticket-ttl", str(ticket_ttl_s)])
            comps.append(c)
        return replace(
            p, components=comps, router_config=p.router_config.model_copy(update={"handoff_probe": probes})
        )

    local = local_cli.launch(
        name,
        spec,
        state_dir,
        file=str(EXAMPLE),
        router_port=router_port or runner.free_port(),
        timeout=timeout,
        say=say,
        adjust=adjust,
        warm_up=False,
    )
    node = next(c for c in local.plan.components if c.kind == constants.TILERT)
    return Stack(local, node_secret, node)
