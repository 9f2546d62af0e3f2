"""Specs that the CRD's schema and CEL accept but that fail later: a child the API server refuses
with 422 (found by rendering a valid spec with one field changed and checking the children against
the Kubernetes schemas and the API server's own rules), or a pod that cannot run as asked (SIGKILL
before any drain, a root user under runAsNonRoot, a Secret or network that cannot exist). Each is
refused before it is stored by the webhook, and reported as SpecValid=False without it, naming the
PDCluster's field and the fix."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import kopf
import kubernetes_validate
import pdc_crd_validator as crd_validator
import pdc_harness as h
import pdc_helpers as helpers
import pytest

from tilert_operator import admission, childcheck, reconcile, render, validation
from tilert_operator import spec as specmod

T = TypeVar("T")

HOSTNAME = "kubernetes.io/hostname"
RDMA = {"protocol": "rdma", "rdma": {"resources": {"rdma/ib": 1}}}


def _pvc(volume: dict[str, Any]) -> dict[str, Any]:
    return {"model": {"weights": {"tiny": False, "volume": volume}}}


def _template(pod: dict[str, Any]) -> dict[str, Any]:
    return {"overrides": {"spec": {"template": {"spec": pod}}}}


#: (id, spec patch over helpers.minimal(), the PDCluster field named, a piece of the fix, how it broke).
#: "422": the API server refuses a child; "schema": so does the Kubernetes schema (checked below);
#: "run": every server accepts it and the pods cannot do what the spec asks; "cel": so do they, and the
#: CRD's CEL refuses it too (without the webhook, kubectl apply is refused; with it, the webhook first).
TRAPS: list[tuple[str, dict[str, Any], str, str, str]] = [
    (
        "override-container-without-image",
        {"prefill": _template({"containers": [{"name": "vllm"}]})},
        "spec.prefill.overrides",
        "set an image",
        "422",
    ),
    (
        "override-label-value-70",
        {"router": {"overrides": {"spec": {"template": {"metadata": {"labels": {"team": "x" * 70}}}}}}},
        "spec.router.overrides",
        "at most 63",
        "422",
    ),
    (
        "volume-claim-without-name",
        _pvc({"persistentVolumeClaim": {}}),
        "spec.model.weights.volume",
        "claimName",
        "schema",
    ),
    (
        "volume-claim-name-empty",
        _pvc({"persistentVolumeClaim": {"claimName": ""}}),
        "spec.model.weights.volume",
        "claimName",
        "422",
    ),
    # An empty source renders as an emptyDir: the pods start and find no model.
    ("volume-without-source", _pvc({}), "spec.model.weights.volume", "one volume source", "run"),
    (
        "volume-two-sources",
        _pvc({"emptyDir": {}, "hostPath": {"path": "/m"}}),
        "spec.model.weights.volume",
        "one volume source",
        "422",
    ),
    (
        "volume-renamed",
        _pvc({"name": "weights", "persistentVolumeClaim": {"claimName": "c"}}),
        "spec.model.weights.volume",
        "remove name",
        "422",
    ),
    (
        "volume-host-path-empty",
        _pvc({"hostPath": {"path": ""}}),
        "spec.model.weights.volume",
        "hostPath.path",
        "422",
    ),
    (
        "override-surge-and-unavailable-0",
        {
            "router": {
                "overrides": {"spec": {"strategy": {"rollingUpdate": {"maxSurge": 0, "maxUnavailable": 0}}}}
            }
        },
        "spec.router.overrides",
        "maxSurge",
        "422",
    ),
    (
        "override-recreate-keeps-rolling-update",
        {"prefill": {"overrides": {"spec": {"strategy": {"type": "Recreate"}}}}},
        "spec.prefill.overrides",
        "rollingUpdate: null",
        "422",
    ),
    (
        "override-restart-policy",
        {"router": _template({"restartPolicy": "Never"})},
        "spec.router.overrides",
        "Always",
        "422",
    ),
    (
        "override-renames-workload",
        {"prefill": {"overrides": {"metadata": {"name": "other"}}}},
        "spec.prefill.overrides",
        "metadata.name",
        "run",
    ),
    (
        "tilert-statefulset-max-unavailable-0",
        {"decode": {"tilert": {"rollout": {"maxUnavailable": 0}}}},
        "spec.decode.tilert.rollout",
        "at least 1",
        "422",
    ),
    (
        "image-whitespace",
        {"prefill": {"image": "vllm/vllm-openai:v0.32.0 "}},
        "spec.prefill.image",
        "whitespace",
        "422",
    ),
    (
        "image-uppercase",
        {"decode": {"tilert": {"image": "ghcr.io/TileRT/serve:0.1.0-cpu"}}},
        "spec.decode.tilert.image",
        "lowercase",
        "run",
    ),
    (
        "privileged-without-escalation",
        {"prefill": {"securityContext": {"privileged": True}}},
        "spec.prefill.securityContext",
        "privileged",
        "422",
    ),
    (
        "sys-admin-without-escalation",
        {"router": {"securityContext": {"capabilities": {"add": ["CAP_SYS_ADMIN"]}}}},
        "spec.router.securityContext",
        "CAP_SYS_ADMIN",
        "422",
    ),
    (
        "security-context-wrong-type",
        {"prefill": {"securityContext": {"readOnlyRootFilesystem": "yes"}}},
        "spec.prefill.securityContext",
        "boolean",
        "schema",
    ),
    (
        "security-context-unknown-field",
        {"router": {"securityContext": {"runAsRoot": True}}},
        "spec.router.securityContext",
        "runAsRoot",
        "schema",
    ),
    (
        "run-as-user-negative",
        {"prefill": {"podSecurityContext": {"runAsUser": -1}}},
        "spec.prefill.podSecurityContext",
        "0 to 2147483647",
        "422",
    ),
    (
        "seccomp-localhost-without-profile",
        {"router": {"podSecurityContext": {"seccompProfile": {"type": "Localhost"}}}},
        "spec.router.podSecurityContext",
        "localhostProfile",
        "422",
    ),
    (
        "sysctl-name",
        {"prefill": {"podSecurityContext": {"sysctls": [{"name": "net ipv4", "value": "1"}]}}},
        "spec.prefill.podSecurityContext",
        "sysctl",
        "422",
    ),
    (
        "fs-group-change-policy",
        {"router": {"podSecurityContext": {"fsGroupChangePolicy": "Sometimes"}}},
        "spec.router.podSecurityContext",
        "OnRootMismatch",
        "422",
    ),
    (
        "resource-name-not-qualified",
        {"prefill": {"resources": {"limits": {"gpu": 1}}}},
        "spec.prefill.resources",
        "gpu",
        "422",
    ),
    (
        "extended-resource-fraction",
        {
            "prefill": {
                "resources": {
                    "requests": {"example.com/fpga": "500m"},
                    "limits": {"example.com/fpga": "500m"},
                }
            }
        },
        "spec.prefill.resources",
        "whole number",
        "422",
    ),
    (
        "extended-resource-without-limit",
        {"prefill": {"resources": {"requests": {"example.com/fpga": 1}}}},
        "spec.prefill.resources",
        "limits",
        "422",
    ),
    (
        "hugepages-alone",
        {
            "prefill": {
                "resources": {"requests": {"hugepages-2Mi": "1Gi"}, "limits": {"hugepages-2Mi": "1Gi"}}
            }
        },
        "spec.prefill.resources",
        "cpu or memory",
        "422",
    ),
    (
        "toleration-empty-key-equal",
        {"prefill": {"tolerations": [{"operator": "Equal", "value": "v"}]}},
        "spec.prefill.tolerations",
        "operator: Exists",
        "422",
    ),
    (
        "toleration-seconds-not-no-execute",
        {
            "prefill": {
                "tolerations": [
                    {"key": "k", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30}
                ]
            }
        },
        "spec.prefill.tolerations",
        "NoExecute",
        "422",
    ),
    (
        "toleration-key",
        {"router": {"tolerations": [{"key": "gpu type", "operator": "Exists"}]}},
        "spec.router.tolerations",
        "key",
        "422",
    ),
    (
        "toleration-value",
        {"decode": {"tilert": {"tolerations": [{"key": "k", "value": "a b"}]}}},
        "spec.decode.tilert.tolerations",
        "label value",
        "422",
    ),
    (
        "topology-key",
        {"prefill": {"topologySpread": {"topologyKeys": ["zone name"]}}},
        "spec.prefill.topologySpread",
        "label key",
        "422",
    ),
    (
        "topology-key-twice",
        {"router": {"topologySpread": {"topologyKeys": [HOSTNAME, HOSTNAME]}}},
        "spec.router.topologySpread",
        "once",
        "422",
    ),
    (
        "metrics-from-cidr",
        {"networkPolicies": {"metricsFrom": [{"ipBlock": {"cidr": "10.0.0.0"}}]}},
        "spec.networkPolicies.metricsFrom",
        "CIDR",
        "422",
    ),
    (
        "metrics-from-ip-block-and-selector",
        {"networkPolicies": {"metricsFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "namespaceSelector": {}}]}},
        "spec.networkPolicies.metricsFrom",
        "ipBlock",
        "422",
    ),
    (
        "metrics-from-except-outside",
        {
            "networkPolicies": {
                "metricsFrom": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["192.168.0.0/16"]}}]
            }
        },
        "spec.networkPolicies.metricsFrom",
        "within",
        "422",
    ),
    (
        "metrics-from-in-without-values",
        {
            "networkPolicies": {
                "metricsFrom": [
                    {"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "In"}]}}
                ]
            }
        },
        "spec.networkPolicies.metricsFrom",
        "values",
        "422",
    ),
    (
        "pre-stop-longer-than-grace",
        {"router": {"termination": {"gracePeriodSeconds": 10, "preStopSleepSeconds": 30}}},
        "spec.router.termination.preStopSleepSeconds",
        "gracePeriodSeconds",
        "cel",
    ),
    (
        "pre-stop-leaves-no-drain",
        {"prefill": {"termination": {"gracePeriodSeconds": 8, "preStopSleepSeconds": 5}}},
        "spec.prefill.termination.preStopSleepSeconds",
        "gracePeriodSeconds",
        "cel",
    ),
    (
        "rdma-pool-run-as-non-root",
        {"transfer": RDMA, "prefill": {"podSecurityContext": {"runAsNonRoot": True}}},
        "spec.prefill.podSecurityContext",
        "runAsNonRoot",
        "run",
    ),
    (
        "root-user-under-default-non-root",
        {"router": {"podSecurityContext": {"runAsUser": 0}}},
        "spec.router.podSecurityContext",
        "runAsNonRoot",
        "run",
    ),
    (
        "container-root-user",
        {"prefill": {"securityContext": {"runAsUser": 0}}},
        "spec.prefill.securityContext",
        "runAsNonRoot",
        "run",
    ),
    (
        "api-keys-secret-name",
        {"router": {"apiKeysSecret": {"name": "API_keys"}}},
        "spec.router.apiKeysSecret.name",
        "lowercase",
        "run",
    ),
    (
        "api-keys-secret-key",
        {"router": {"apiKeysSecret": {"name": "keys", "key": "keys/v1"}}},
        "spec.router.apiKeysSecret.key",
        "letters, digits",
        "run",
    ),
    (
        "rdma-network-name",
        {"transfer": {"rdma": {"networks": ["RDMA_net"]}}},
        "spec.transfer.rdma.networks[0]",
        "lowercase",
        "run",
    ),
]
IDS = [t[0] for t in TRAPS]

#: Near misses of the traps that real servers accept and that run: the checks must not refuse them.
FINE: list[tuple[str, dict[str, Any]]] = [
    (
        "sys-admin-spelled-without-cap",
        {"router": {"securityContext": {"capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]}}}},
    ),
    (
        "rdma-non-root-user-named",
        {"transfer": RDMA, "prefill": {"podSecurityContext": {"runAsNonRoot": True, "runAsUser": 1000}}},
    ),
    ("root-allowed-explicitly", {"router": {"podSecurityContext": {"runAsUser": 0, "runAsNonRoot": False}}}),
    ("host-path-directory", _pvc({"hostPath": {"path": "/models", "type": "Directory"}})),
    ("toleration-everything", {"prefill": {"tolerations": [{"operator": "Exists"}]}}),
    (
        "toleration-no-execute-seconds",
        {
            "prefill": {
                "tolerations": [
                    {"key": "k", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30}
                ]
            }
        },
    ),
    ("no-spread", {"router": {"topologySpread": {"topologyKeys": []}}}),
    ("tilert-max-unavailable-2", {"decode": {"tilert": {"replicas": 4, "rollout": {"maxUnavailable": 2}}}}),
    (
        "metrics-from-except-inside",
        {
            "networkPolicies": {
                "metricsFrom": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}]
            }
        },
    ),
    (
        "metrics-from-expression",
        {
            "networkPolicies": {
                "metricsFrom": [
                    {
                        "namespaceSelector": {
                            "matchExpressions": [
                                {
                                    "key": "kubernetes.io/metadata.name",
                                    "operator": "In",
                                    "values": ["monitoring"],
                                }
                            ]
                        }
                    }
                ]
            }
        },
    ),
    (
        "image-registry-port-digest",
        {"prefill": {"image": "registry.local:5000/team/vllm@sha256:" + "a" * 64}},
    ),
    (
        "extended-resource-whole",
        {
            "prefill": {
                "resources": {"requests": {"example.com/fpga": 1}, "limits": {"example.com/fpga": "1"}}
            }
        },
    ),
    (
        "hugepages-with-memory",
        {
            "prefill": {
                "resources": {
                    "requests": {"hugepages-2Mi": "1Gi", "memory": "2Gi"},
                    "limits": {"hugepages-2Mi": "1Gi", "memory": "2Gi"},
                }
            }
        },
    ),
    ("drain-just-fits", {"router": {"termination": {"gracePeriodSeconds": 11, "preStopSleepSeconds": 5}}}),
    (
        "no-pre-stop-short-grace",
        {"router": {"termination": {"gracePeriodSeconds": 1, "preStopSleepSeconds": 0}}},
    ),
    (
        "override-recreate-done-right",
        {"prefill": {"overrides": {"spec": {"strategy": {"type": "Recreate", "rollingUpdate": None}}}}},
    ),
    ("override-priority-class", {"prefill": _template({"priorityClassName": "high"})}),
    ("api-keys-secret", {"router": {"apiKeysSecret": {"name": "router-keys", "key": "keys.txt"}}}),
    ("network-in-namespace", {"transfer": {"rdma": {"networks": ["infra/rdma-net.v1"]}}}),
]


@pytest.mark.parametrize("patch", [f[1] for f in FINE], ids=[f[0] for f in FINE])
def test_near_misses_that_real_servers_accept_pass_every_check(patch: dict[str, Any]) -> None:
    spec = helpers.minimal(**patch)
    assert crd_validator.validate(helpers.cr(spec))[1] == []
    assert validation.validate(spec, "t")[1] == []
    admission.check(spec, "t")


def test_the_list_is_long_and_each_case_is_its_own() -> None:
    assert len(TRAPS) >= 25 and len(set(IDS)) == len(IDS)


@pytest.mark.parametrize(("patch", "field", "fix", "how"), [t[1:] for t in TRAPS], ids=IDS)
def test_the_crd_accepts_it_and_the_operator_refuses_it_naming_field_and_fix(
    patch: dict[str, Any], field: str, fix: str, how: str
) -> None:
    spec = helpers.minimal(**patch)
    _, errors = crd_validator.validate(helpers.cr(spec))
    if how == "cel":
        assert any(field.rsplit(".", 1)[0] in e and fix in e for e in errors), errors
    else:
        assert errors == [], "the CRD refuses it already: not a trap"
    _, problems = validation.validate(spec, "t")
    assert any(p.field == field and fix in p.message for p in problems), [str(p) for p in problems]


def test_the_crds_drain_rule_keeps_the_operators_exit_margin() -> None:
    spec = crd_validator.load_schema()["properties"]["spec"]["properties"]
    pools = [
        spec["prefill"],
        spec["decode"]["properties"]["tilert"],
        spec["decode"]["properties"]["native"],
        spec["router"],
    ]
    for pool in pools:
        [rule] = pool["properties"]["termination"]["x-kubernetes-validations"]
        assert f"self.preStopSleepSeconds + {specmod.EXIT_MARGIN_S} < self.gracePeriodSeconds" in rule["rule"]


@pytest.mark.parametrize(
    "patch", [t[1] for t in TRAPS if t[4] == "schema"], ids=[t[0] for t in TRAPS if t[4] == "schema"]
)
def test_the_schema_cases_are_refused_by_the_kubernetes_schema(patch: dict[str, Any]) -> None:
    children = render.children(specmod.parse(helpers.minimal(**patch)), "t", "default")
    refused = []
    for obj in children:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            try:
                kubernetes_validate.validate(obj, helpers.K8S_VERSION, strict=True)
            except kubernetes_validate.ValidationError:
                refused.append(obj["metadata"]["name"])
    assert refused


@pytest.mark.parametrize(("patch", "field"), [t[1:3] for t in TRAPS], ids=IDS)
def test_the_webhook_refuses_it_before_it_is_stored(patch: dict[str, Any], field: str) -> None:
    with pytest.raises(kopf.AdmissionError) as refused:
        admission.check(helpers.minimal(**patch), "t")
    assert f"{field}: " in str(refused.value)


def test_without_the_webhook_each_is_spec_valid_false_and_nothing_is_applied(apiserver: Any) -> None:
    srv = apiserver.server
    # Stored as an older CRD (without the drain rule) would have let them in.
    srv.validators.pop(("pd.tilert.ai", "v1alpha1", "pdclusters"))
    for i, (case, patch, field, _fix, _how) in enumerate(TRAPS):
        name = f"t{i}"
        h.run(apiserver, lambda api, n=name, p=patch: api.create(h.pdc(helpers.cr(helpers.minimal(**p), n))))
        out = h.run(
            apiserver, lambda api, n=name: reconcile.reconcile(api, srv.get("pdclusters", "default", n))
        )
        assert out.state == "invalid" and not out.applied, case
        cond = h.condition(srv.get("pdclusters", "default", name), "SpecValid")
        assert cond["status"] == "False" and f"{field}: " in cond["message"], (case, cond)
        assert srv.get("deployments", "default", f"{name}-prefill") is None, case


def test_the_examples_and_their_children_pass_the_checks() -> None:
    import yaml

    for path in helpers.EXAMPLES:
        doc = yaml.safe_load(path.read_text())
        spec = specmod.parse(doc["spec"])
        for obj in render.children(spec, doc["metadata"]["name"], "default"):
            assert childcheck.findings(obj) == [], (path.stem, obj["kind"])


# ---- the webhook: only spec changes are judged; deletion is never refused --------------------------

STORED_BAD = helpers.minimal(prefill={"termination": {"gracePeriodSeconds": 8, "preStopSleepSeconds": 5}})


def test_a_metadata_only_update_of_an_invalid_stored_spec_passes_and_a_spec_change_is_judged() -> None:
    """A spec stored before the webhook (or before a stricter operator): its labels, annotations and
    finalizers can still change (a foreground delete waits on finalizers removed by such updates)."""
    admission.check(STORED_BAD, "t", old_spec=STORED_BAD)
    with pytest.raises(kopf.AdmissionError) as refused:
        admission.check(
            helpers.deep_merge(STORED_BAD, {"prefill": {"replicas": 2}}), "t", old_spec=STORED_BAD
        )
    assert "spec.prefill.termination.preStopSleepSeconds: " in str(refused.value)
    # The fix itself is a spec change, and it passes.
    admission.check(helpers.minimal(), "t", old_spec=STORED_BAD)
    asyncio.run(admission.review(STORED_BAD, "t", "default", STORED_BAD, api=_Refusing([])))  # type: ignore[arg-type]


def test_the_chart_never_sends_a_deletion_to_the_webhook() -> None:
    import yaml

    text = (helpers.ROOT / "charts" / "tilert-pd" / "templates" / "webhook.yaml").read_text()
    [rules] = [line for line in text.splitlines() if line.strip().startswith("operations:")]
    assert yaml.safe_load(rules.strip())["operations"] == ["CREATE", "UPDATE"]


# ---- the webhook's server-side dry run ------------------------------------------------------------


class _Refusing:
    """An API client whose server refuses the dry-run apply of the named children (as a cluster's
    admission policy would), or answers `status` for all of them, or takes `delay` seconds."""

    def __init__(self, refuse: list[str], *, status: int = 422, delay: float = 0.0) -> None:
        self.refuse, self.status, self.delay = refuse, status, delay
        self.calls: list[tuple[str, str, dict[str, str]]] = []

    async def request(
        self,
        verb: str,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
        **_: Any,
    ) -> tuple[int, dict[str, Any] | None]:
        import json

        from tilert_operator.kubeapi import ApiError

        self.calls.append((method, path, dict(params or {})))
        await asyncio.sleep(self.delay)
        name = body["metadata"]["name"]
        if self.status != 422:
            raise ApiError(self.status, method, path, "forbidden")
        if name in self.refuse:
            status = {
                "kind": "Status",
                "status": "Failure",
                "reason": "Invalid",
                "code": 422,
                "message": f'Deployment.apps "{name}" is invalid: ...',
                "details": {
                    "causes": [
                        {
                            "field": "spec.template.spec.containers[0].image",
                            "message": 'Invalid value: "i": images from this registry are not admitted',
                        }
                    ]
                },
            }
            raise ApiError(422, method, path, json.dumps(status))
        return 200, body


def test_the_dry_run_reports_what_only_the_cluster_knows_on_the_field_it_comes_from() -> None:
    api = _Refusing(["t-prefill"])
    with pytest.raises(kopf.AdmissionError) as refused:
        asyncio.run(admission.review(helpers.minimal(), "t", "default", api=api))  # type: ignore[arg-type]
    message = str(refused.value)
    assert message.startswith(
        "spec.prefill.image: the API server refused Deployment t-prefill (dry run): "
        "spec.template.spec.containers[0].image: Invalid value"
    ), message
    # Every child was applied as a dry run, in the PDCluster's namespace, by the operator's field manager.
    assert api.calls and all(
        p == {"fieldManager": "tilert-pd-operator", "force": "true", "dryRun": "All"} for _, _, p in api.calls
    )
    assert all(m == "PATCH" and "/namespaces/default/" in path for m, path, _ in api.calls)
    assert len(api.calls) == len(render.children(specmod.parse(helpers.minimal()), "t", "default"))


def test_the_dry_run_judges_nothing_when_it_cannot_tell() -> None:
    spec = helpers.minimal()
    asyncio.run(admission.review(spec, "t", "default", api=_Refusing([], status=403)))  # type: ignore[arg-type]
    asyncio.run(admission.review(spec, "t", "default", api=_Refusing(["t-prefill"], delay=1.0), budget_s=0.2))  # type: ignore[arg-type]
    # Without a client (the option off, or no API), the offline checks alone.
    asyncio.run(admission.review(spec, "t", "default", api=None))
    # An unchanged spec is not dry-run at all.
    api = _Refusing(["t-prefill"])
    asyncio.run(admission.review(spec, "t", "default", spec, api=api))  # type: ignore[arg-type]
    assert api.calls == []


# ---- the chart: the operator's own servers on one port ----------------------------------------------

CA = "LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCk1JSUIKLS0tLS1FTkQgQ0VSVElGSUNBVEUtLS0tLQo="
SAME_PORT = [
    ({"metrics": {"port": 8081}}, ["metrics.port", "health.port"]),
    (
        {"health": {"port": 9443}, "webhook": {"enabled": True, "tls": {"caBundle": CA}}},
        ["webhook.port", "health.port"],
    ),
    (
        {"metrics": {"port": 9443}, "webhook": {"enabled": True, "tls": {"caBundle": CA}}},
        ["webhook.port", "metrics.port"],
    ),
]


@pytest.mark.parametrize(
    ("values", "fields"), SAME_PORT, ids=["metrics-health", "webhook-health", "webhook-metrics"]
)
def test_the_chart_refuses_two_of_the_operators_servers_on_one_port(
    values: dict[str, Any], fields: list[str]
) -> None:
    """The second server would fail to bind and the operator's pod crash-loop."""
    import helm_python as helm

    with helm.Chart.load(helpers.ROOT / "charts" / "tilert-pd") as chart:
        with pytest.raises(helm.HelmError) as refused:
            chart.render(values, name="tpd", namespace="ops", is_install=True)
        assert all(f in str(refused.value) for f in fields), str(refused.value)
        # A disabled server takes no port.
        chart.render(
            {"metrics": {"enabled": False, "port": 8081}}, name="tpd", namespace="ops", is_install=True
        )


async def _webhook_with_dry_run(
    spec: kopf.Spec, name: str, namespace: str | None, memo: kopf.Memo, old: kopf.Body | None = None, **_: Any
) -> None:
    """The handler as wiring.py registers it with the dry run on: the operator's API client from the
    startup memo, the PDCluster's namespace."""
    api = memo.get("api") if admission.dry_run_enabled() else None
    await admission.review(dict(spec), name, namespace, dict(old.get("spec") or {}) if old else None, api=api)


def test_kopf_hands_the_webhook_the_operators_client_and_the_namespace(
    apiserver: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import test_op_admission as webhook
    from kopf.testing import KopfRunner

    from tilert_operator import constants, wiring
    from tilert_serve.local.runner import free_port

    refusing = _Refusing(["t-router"])

    async def startup(memo: kopf.Memo, **_: Any) -> None:
        memo.api = refusing

    port = free_port()
    default = kopf.get_default_registry()
    registry = kopf.OperatorRegistry()
    kopf.on.login(registry=registry)(wiring.login)
    kopf.on.startup(registry=registry)(startup)
    kopf.on.validate(
        constants.GROUP, constants.VERSION, constants.PLURAL, id="validate-pdcluster", registry=registry
    )(_webhook_with_dry_run)
    settings = kopf.OperatorSettings()
    settings.admission.server = kopf.WebhookServer(addr="127.0.0.1", port=port, insecure=True)
    settings.admission.managed = None
    try:
        with KopfRunner(
            ["run", "--all-namespaces", "--standalone"], registry=registry, settings=settings, timeout=20
        ):
            answer = h.wait_for(
                "the webhook", lambda: _try(lambda: webhook._post(port, webhook._review(helpers.minimal())))
            )
            assert (
                answer["allowed"] is False
                and "spec.router.image: the API server refused Deployment t-router"
                in answer["status"]["message"]
            )
            assert {p for _, p, _ in refusing.calls} >= {
                "/apis/apps/v1/namespaces/default/deployments/t-router"
            }
            monkeypatch.setenv(admission.DRY_RUN_ENV, "0")
            assert webhook._post(port, webhook._review(helpers.minimal()))["allowed"] is True
    finally:
        kopf.set_default_registry(default)


def _try(fn: Callable[[], T]) -> T | None:
    try:
        return fn()
    except OSError:
        return None
