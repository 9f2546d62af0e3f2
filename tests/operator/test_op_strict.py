"""The API test server is as strict as a real kube-apiserver where the operator depends on it (names,
label values, canonical quantities, 422 Invalid with causes, server-side apply's typed conversion,
StatefulSet names), and the operator writes nothing when nothing changed, quantities compared by value."""

from __future__ import annotations

import asyncio
import json
from typing import Any, TypeVar

import aiohttp
import pdc_harness as h
import pdc_helpers as helpers
import pdc_k8s_semantics as sem
import pytest
import yaml

from tilert_operator import constants, reconcile, reconcile_compare, render, validation
from tilert_operator import spec as specmod
from tilert_operator.kubeapi import KINDS, Client

T = TypeVar("T")

#: (what a client writes, what a real API server stores): resource.Quantity.String() of the parse.
CANONICAL = [
    ("0.5", "500m"),
    ("1.5Gi", "1536Mi"),
    ("1000m", "1"),
    ("2000", "2k"),
    ("1.5k", "1500"),
    ("100Mi", "100Mi"),
    ("1024", "1024"),
    ("1Ki", "1Ki"),
    ("0.5Ki", "512"),
    ("2048Ki", "2Mi"),
    ("1536Ki", "1536Ki"),
    ("1e3", "1e3"),
    ("12e6", "12e6"),
    ("1.5e3", "1500"),
    ("0.1m", "100u"),
    ("0.5n", "1n"),
    ("-1", "-1"),
    (8, "8"),
    ("1.0", "1"),
    ("1000k", "1M"),
    ("0", "0"),
    ("0Gi", "0"),
    ("1E", "1E"),
    ("0.001", "1m"),
    ("100m", "100m"),
    ("1.5", "1500m"),
    ("2Gi", "2Gi"),
    ("1073741824", "1073741824"),
    ("1G", "1G"),
    ("1.25", "1250m"),
    ("+3", "3"),
    (".5", "500m"),
]


@pytest.mark.parametrize(("written", "stored"), CANONICAL, ids=[str(w) for w, _ in CANONICAL])
def test_quantities_are_stored_canonical_and_the_operator_reads_the_same_value(
    written: Any, stored: str
) -> None:
    assert sem.canonical_quantity(written) == stored
    # The operator's parser (used to compare by meaning) agrees with the server's on the value.
    assert (
        validation.parse_quantity(written)
        == validation.parse_quantity(stored)
        == sem.parse_quantity(stored)[0]
    )


@pytest.mark.parametrize("bad", ["lots", "1K", "1.5.5", "", "Gi", "1 Gi", "1Gib"])
def test_unparsable_quantities_are_refused_by_both(bad: str) -> None:
    with pytest.raises(sem.QuantityError):
        sem.parse_quantity(bad)
    with pytest.raises(ValueError):
        validation.parse_quantity(bad)


async def _apply(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as s,
        s.patch(
            url + path,
            data=json.dumps(body),
            params={"fieldManager": "t", "force": "true"},
            headers={"Content-Type": "application/apply-patch+yaml"},
        ) as r,
    ):
        return r.status, await r.json()


def apply(apiserver: Any, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    prefix = {"v1": "/api/v1"}.get(body["apiVersion"], f"/apis/{body['apiVersion']}")
    plural = {
        "Service": "services",
        "Deployment": "deployments",
        "StatefulSet": "statefulsets",
        "NetworkPolicy": "networkpolicies",
    }[body["kind"]]
    return asyncio.run(
        _apply(apiserver.url, f"{prefix}/namespaces/default/{plural}/{body['metadata']['name']}", body)
    )


def deployment(name: str = "d", **pod: Any) -> dict[str, Any]:
    container = {"name": "c", "image": "i"} | pod.pop("container", {})
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "selector": {"matchLabels": {"a": "b"}},
            "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": [container], **pod}},
        },
    }


def test_a_service_named_like_a_valid_cr_is_refused_with_a_real_422(apiserver: Any) -> None:
    code, status = apply(
        apiserver,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "1tiny-prefill"},
            "spec": {"ports": [{"port": 80}]},
        },
    )
    assert code == 422
    assert (
        status["kind"] == "Status"
        and status["status"] == "Failure"
        and status["reason"] == "Invalid"
        and status["code"] == 422
    )
    assert status["message"].startswith(
        'Service "1tiny-prefill" is invalid: metadata.name: Invalid value: "1tiny-prefill": a DNS-1035 label'
    )
    assert status["details"]["kind"] == "Service" and "group" not in status["details"]
    [cause] = status["details"]["causes"]
    assert cause["reason"] == "FieldValueInvalid" and cause["field"] == "metadata.name"
    assert cause["message"].startswith(
        'Invalid value: "1tiny-prefill": a DNS-1035 label must consist of lower case'
    )
    # The same name is fine for a Deployment (a DNS-1123 subdomain).
    assert apply(apiserver, deployment("1tiny-prefill"))[0] == 201


def test_statefulset_names_longer_than_52_are_refused_and_52_fit(apiserver: Any) -> None:
    def sts(name: str) -> dict[str, Any]:
        return deployment(name) | {"kind": "StatefulSet"}

    code, status = apply(apiserver, sts("a" * 53))
    assert code == 422 and "controller-revision-hash" in status["message"] and "52" in status["message"]
    assert apply(apiserver, sts("a" * 52))[0] == 201


@pytest.mark.parametrize(
    ("body", "code", "expect"),
    [
        (
            deployment(container={"resources": {"limits": {"cpu": "lots"}}}),
            400,
            "quantities must match the regular expression",
        ),
        (
            deployment(
                container={"env": [{"name": "POD_IP", "value": "a"}, {"name": "POD_IP", "value": "b"}]}
            ),
            500,
            'env: duplicate entries for key [name="POD_IP"]',
        ),
        (
            deployment(tolerations=[{"key": "k", "operatr": "Exists"}]),
            500,
            ".spec.template.spec.tolerations[0].operatr: field not declared in schema",
        ),
        (
            deployment(container={"env": [{"name": "1X", "value": "a"}]}),
            422,
            "a valid environment variable name",
        ),
        (
            deployment(container={"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}}),
            422,
            "must be less than or equal to cpu limit",
        ),
        (
            {**deployment(), "spec": {**deployment()["spec"], "selector": None}},
            422,
            "spec.selector: Required value",
        ),
        (
            deployment() | {"metadata": {"name": "d", "labels": {"x": "-bad-"}}},
            422,
            "a valid label must be an empty string",
        ),
        (
            {
                "apiVersion": "networking.k8s.io/v1",
                "kind": "NetworkPolicy",
                "metadata": {"name": "n"},
                "spec": {"podSelector": {}, "ingress": [{"from": [{}]}]},
            },
            422,
            "spec.ingress[0].from[0]: Required value: must specify a peer",
        ),
    ],
    ids=[
        "bad-quantity",
        "duplicate-env",
        "unknown-field",
        "env-name",
        "request-over-limit",
        "no-selector",
        "label-value",
        "empty-peer",
    ],
)
def test_built_in_objects_are_refused_as_a_real_server_refuses_them(
    apiserver: Any, body: dict[str, Any], code: int, expect: str
) -> None:
    got, status = apply(apiserver, body)
    assert (got, status["code"]) == (code, code) and expect in status["message"], status


def test_every_child_the_operator_renders_passes_the_strict_server(apiserver: Any) -> None:
    """Each example's children, applied through the operator's client: none is refused, and what the
    server stores is what the operator compares equal to its intent."""
    for path in helpers.EXAMPLES:
        doc = yaml.safe_load(path.read_text())
        spec = specmod.parse(doc["spec"])
        # Kinds the operator's client writes (another change may be adding some).
        children = [
            c for c in render.children(spec, doc["metadata"]["name"], "default") if c["kind"] in KINDS
        ]
        h.install_crd(apiserver, h.MULTI_NETWORK_POLICY_CRD)

        async def go(api: Client, children: list[dict[str, Any]] = children) -> list[dict[str, Any]]:
            return [
                await api.apply(c | {"metadata": c["metadata"] | {"namespace": "default"}}) for c in children
            ]

        stored = h.run(apiserver, go)
        for want, have in zip(children, stored, strict=True):
            assert reconcile_compare.contains(have, want), (path.stem, want["kind"], want["metadata"]["name"])


def create(apiserver: Any, doc: dict[str, Any]) -> None:
    """Create a PDCluster through the API (defaulted and validated like kubectl apply's)."""
    h.run(apiserver, lambda api: api.create(h.pdc(doc)))


async def _reconcile_twice(
    api: Client, apiserver: Any, name: str
) -> tuple[reconcile.Outcome, reconcile.Outcome]:
    body = apiserver.server.get("pdclusters", "default", name)
    first = await reconcile.reconcile(api, body)
    # The workload controllers report the generation they saw, and the status says so once.
    await reconcile.reconcile(api, apiserver.server.get("pdclusters", "default", name))
    body = apiserver.server.get("pdclusters", "default", name)
    second = await reconcile.reconcile(api, body)
    return first, second


def test_non_canonical_quantities_in_the_spec_cause_no_writes_on_resync(
    apiserver: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = apiserver.server
    resources = {"requests": {"cpu": "0.5", "memory": "1.5Gi"}, "limits": {"cpu": "1000m", "memory": "1.5Gi"}}
    spec = helpers.minimal(
        prefill={"resources": resources}, router={"resources": resources}, transfer={"shmSize": "1.5Gi"}
    )
    create(apiserver, helpers.cr(spec, "q"))
    first, second = h.run(apiserver, lambda api: _reconcile_twice(api, apiserver, "q"))
    assert first.applied and not first.failed
    dep = srv.get("deployments", "default", "q-prefill")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["requests"]["cpu"] == "500m" and c["resources"]["limits"]["cpu"] == "1"
    assert c["resources"]["requests"]["memory"] == "1536Mi"  # the server canonicalised what the spec said
    shm = [
        v
        for v in dep["spec"]["template"]["spec"]["volumes"]
        if "emptyDir" in v and v["emptyDir"].get("sizeLimit")
    ]
    assert shm and shm[0]["emptyDir"]["sizeLimit"] == "1536Mi"
    assert second.applied == [] and second.writes == 0, second

    # Comparing the strings instead (what the operator did before) rewrites them every resync: the
    # test catches that regression.
    monkeypatch.setattr(reconcile_compare, "is_quantity", lambda path: False)
    _, third = h.run(apiserver, lambda api: _reconcile_twice(api, apiserver, "q"))
    assert f"Deployment/{constants.child_name('q', constants.PREFILL)}" in third.applied


def test_empty_values_the_server_omits_cause_no_writes_on_resync(apiserver: Any) -> None:
    """An env var with an empty value comes back without `value` (omitempty): still no write."""
    srv = apiserver.server
    create(apiserver, helpers.cr(helpers.minimal(transfer={"rdma": {"env": {"MC_EMPTY": ""}}}), "e"))
    first, second = h.run(apiserver, lambda api: _reconcile_twice(api, apiserver, "e"))
    assert first.applied and not first.failed
    env = srv.get("deployments", "default", "e-prefill")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "MC_EMPTY"} in env
    assert second.applied == [] and second.writes == 0, second
