"""The Helm chart, with the real Helm engine: lint, render over a matrix of values, validate every
rendered object with kubernetes-validate --strict, refuse bad values through values.schema.json, and
keep the ClusterRole and the CRD identical to their one source (operator/tilert_operator/rbac.yaml,
crds/pdcluster.yaml).

Not proven here (no cluster on this machine): a real `helm install`/`upgrade`, RBAC enforcement,
webhook TLS, cert-manager's CA injection, or that the operator image starts.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tilert_operator.render import network

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "charts" / "tilert-pd"
CRD_FILE = ROOT / "crds" / "pdcluster.yaml"
RBAC_FILE = ROOT / "operator" / "tilert_operator" / "rbac.yaml"
WIRING = ROOT / "operator" / "tilert_operator" / "wiring.py"
CA = "TFMwdExTMUNSVWRKVGlCRFJWSlVTVVpKUTBGVVJTMHRMUzB0Q2c9PQ=="  # base64 text: only its shape matters here
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest schema set shipped
# by kubernetes-validate.
K8S_VERSIONS = ("1.29.0", "1.37.0")
# Kinds kubernetes-validate has no schema for: cert-manager's custom resources (checked by hand below).
CERT_MANAGER = "cert-manager.io/v1"

MATRIX: dict[str, tuple[dict[str, Any], str]] = {
    "defaults": ({}, "tilert-system"),
    "webhook-own-tls": (
        {
            "webhook": {
                "enabled": True,
                "failurePolicy": "Ignore",
                "tls": {"secretName": "my-webhook-tls", "caBundle": CA},
            }
        },
        "ops",
    ),
    "webhook-cert-manager-selfsigned": (
        {"webhook": {"enabled": True, "certManager": {"enabled": True}}},
        "tilert-system",
    ),
    "webhook-cert-manager-clusterissuer": (
        {
            "webhook": {
                "enabled": True,
                "port": 8443,
                "timeoutSeconds": 5,
                "certManager": {
                    "enabled": True,
                    "issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"},
                },
            },
            "operator": {"watchNamespaces": ["team-a", "team-b"]},
        },
        "platform",
    ),
    "resources-and-scheduling": (
        {
            "resources": {
                "requests": {"cpu": "250m", "memory": "512Mi"},
                "limits": {"cpu": 1, "memory": "2Gi"},
            },
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [
                {"key": "dedicated", "operator": "Equal", "value": "control", "effect": "NoSchedule"}
            ],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}
                                ]
                            }
                        ]
                    }
                }
            },
            "priorityClassName": "system-cluster-critical",
            "podAnnotations": {"prometheus.io/scrape": "true"},
            "podLabels": {"team": "ml"},
        },
        "default",
    ),
    "image-overrides": (
        {
            "image": {
                "repository": "registry.example.com:5000/mirror/tilert-pd-operator",
                "tag": "0.1.0@sha256:" + "a" * 64,
                "pullPolicy": "Always",
            },
            "imagePullSecrets": [{"name": "regcred"}],
            "fullnameOverride": "pd-operator",
            "nameOverride": "pd",
        },
        "ops",
    ),
    "namespaced-existing-sa-no-metrics": (
        {
            "operator": {
                "watchNamespaces": ["serving"],
                "resyncSeconds": 10,
                "concurrency": 4,
                "apiTimeoutSeconds": 5,
                "secretRotationGraceSeconds": 90,
                "logLevel": "DEBUG",
                "extraEnv": [{"name": "TILERT_PD_WATCH_TIMEOUT_S", "value": "60"}],
            },
            "serviceAccount": {"create": False, "name": "preexisting"},
            "rbac": {"create": False},
            "metrics": {"enabled": False},
        },
        "serving",
    ),
}


def _render(
    chart: Any, values: dict[str, Any], namespace: str, release: str = "tpd"
) -> tuple[list[dict[str, Any]], str]:
    out = chart.render(values, name=release, namespace=namespace, is_install=True)
    objs = [
        o
        for path, text in out.items()
        if not path.endswith("NOTES.txt")
        for o in yaml.safe_load_all(text)
        if o
    ]
    notes = next(text for path, text in out.items() if path.endswith("NOTES.txt"))
    return objs, notes


def _one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def test_values_schema_is_a_valid_draft7_schema_and_accepts_the_defaults() -> None:
    # Helm reports a broken schema only as a confusing install error; check it as a schema first.
    import json

    import jsonschema

    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(yaml.safe_load((CHART_DIR / "values.yaml").read_text()))


def test_lint_strict_is_clean_for_every_matrix_entry() -> None:
    for case, (values, namespace) in MATRIX.items():
        report = helm.lint(CHART_DIR, values, strict=True, namespace=namespace, kube_version="v1.29.0")
        # Severity 1 is informational ("icon is recommended"); strict lint turns warnings into errors.
        problems = [m for m in report["messages"] if m["severity"] > 1]
        assert not report["errors"] and not problems, f"{case}: {report}"


@pytest.mark.parametrize("case", list(MATRIX))
def test_render_matrix_passes_kubernetes_validate_strict(chart: Any, case: str) -> None:
    values, namespace = MATRIX[case]
    objs, _ = _render(chart, values, namespace)
    assert objs
    for obj in objs:
        if obj["apiVersion"] == CERT_MANAGER:
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                raise AssertionError(
                    f"{case}: {obj['kind']}/{obj['metadata']['name']} on {version}: {e}"
                ) from e
        if obj["kind"] in ("Role", "RoleBinding"):
            watched = values["operator"]["watchNamespaces"]
            assert obj["metadata"]["namespace"] in watched, (
                f"{case}: {obj['kind']} outside the watched namespaces"
            )
        elif obj["kind"] not in ("ClusterRole", "ClusterRoleBinding", "ValidatingWebhookConfiguration"):
            assert obj["metadata"]["namespace"] == namespace, (
                f"{case}: {obj['kind']} not in the release namespace"
            )


@pytest.mark.parametrize("case", list(MATRIX))
def test_operator_deployment_contract(chart: Any, case: str) -> None:
    values, namespace = MATRIX[case]
    objs, _ = _render(chart, values, namespace)
    merged = chart.merge_values(values)
    dep = _one(objs, "Deployment")
    spec, pod = dep["spec"], dep["spec"]["template"]["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    assert spec["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    # The TileRT nodes' NetworkPolicy admits the operator's pod (HandoffReady) by these labels.
    peer = network.OPERATOR_PEER["podSelector"]["matchLabels"]
    assert peer.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    (c,) = pod["containers"]
    assert c["command"] == ["tilert-pd", "operator"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert f"--liveness=http://0.0.0.0:{ports['healthz']}/healthz" in c["args"]
    assert [a for a in c["args"] if a.startswith("--namespace=")] == [
        f"--namespace={n}" for n in merged["operator"]["watchNamespaces"]
    ]
    env = _env(c)
    op = merged["operator"]
    assert env["TILERT_PD_RESYNC_S"] == str(op["resyncSeconds"])
    assert env["TILERT_PD_CONCURRENCY"] == str(op["concurrency"])
    assert env["TILERT_PD_API_TIMEOUT_S"] == str(op["apiTimeoutSeconds"])
    assert env["TILERT_PD_SECRET_ROTATION_GRACE_S"] == str(op["secretRotationGraceSeconds"])
    if merged["metrics"]["enabled"]:
        assert env["TILERT_PD_METRICS_PORT"] == str(ports["metrics"]) == str(merged["metrics"]["port"])
    else:
        assert env["TILERT_PD_METRICS_PORT"] == "0" and "metrics" not in ports
    image = merged["image"]
    assert c["image"] == f"{image['repository']}:{image['tag'] or chart.metadata['appVersion']}"
    assert c["imagePullPolicy"] == image["pullPolicy"]
    assert c["resources"] == merged["resources"]
    sa_name = merged["serviceAccount"]["name"] or dep["metadata"]["name"]
    assert pod["serviceAccountName"] == sa_name
    if merged["serviceAccount"]["create"]:
        assert _one(objs, "ServiceAccount")["metadata"]["name"] == sa_name
    else:
        assert not [o for o in objs if o["kind"] == "ServiceAccount"]
    if merged["rbac"]["create"]:
        binding = _one(objs, "ClusterRoleBinding")
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa_name, "namespace": namespace}]
        assert binding["roleRef"]["name"] == _one(objs, "ClusterRole")["metadata"]["name"]
    else:
        assert not [o for o in objs if o["kind"].startswith("ClusterRole")]


def test_operator_command_and_args_are_accepted_by_the_cli(chart: Any) -> None:
    # The chart runs `tilert-pd operator ARGS`: the subcommand must exist and accept every argument.
    import argparse

    from tilert_operator import cli_operator
    from tilert_serve.cli import SUBCOMMANDS

    assert SUBCOMMANDS["operator"][0] == "tilert_operator.cli_operator"
    for case, (values, namespace) in MATRIX.items():
        objs, _ = _render(chart, values, namespace)
        (c,) = _one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
        parser = argparse.ArgumentParser(exit_on_error=False)
        cli_operator.add_arguments(parser)
        args = parser.parse_args(c["args"])
        assert args.namespace == chart.merge_values(values)["operator"]["watchNamespaces"], case


def test_every_env_var_the_chart_sets_is_read_by_the_operator(chart: Any) -> None:
    # A typo in an env name would silently fall back to the operator's default.
    read = set(re.findall(r"TILERT_PD_[A-Z_]+", WIRING.read_text()))
    for case, (values, namespace) in MATRIX.items():
        objs, _ = _render(chart, values, namespace)
        (c,) = _one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
        assert set(_env(c)) <= read, (
            f"{case}: {set(_env(c)) - read} are not read by operator/tilert_operator/wiring.py"
        )


@pytest.mark.parametrize("case", [c for c, (v, _) in MATRIX.items() if v.get("webhook", {}).get("enabled")])
def test_webhook_wiring(chart: Any, case: str) -> None:
    values, namespace = MATRIX[case]
    merged = chart.merge_values(values)
    objs, notes = _render(chart, values, namespace)
    dep = _one(objs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = _env(c)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert env["TILERT_PD_WEBHOOK_PORT"] == str(ports["webhook"]) == str(merged["webhook"]["port"])
    # The cert and key the operator reads are the Secret's files, mounted where the env says.
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "webhook-tls"]
    assert env["TILERT_PD_WEBHOOK_CERT"] == f"{mount['mountPath']}/tls.crt"
    assert env["TILERT_PD_WEBHOOK_KEY"] == f"{mount['mountPath']}/tls.key"
    (volume,) = [v for v in pod["volumes"] if v["name"] == "webhook-tls"]
    secret = volume["secret"]["secretName"]
    assert secret == (merged["webhook"]["tls"]["secretName"] or f"{dep['metadata']['name']}-webhook-tls")

    svc = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"].endswith("-webhook"))
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"][0]["targetPort"] == "webhook"
    vwc = _one(objs, "ValidatingWebhookConfiguration")
    (hook,) = vwc["webhooks"]
    assert hook["failurePolicy"] == merged["webhook"]["failurePolicy"]
    assert hook["clientConfig"]["service"] == {
        "name": svc["metadata"]["name"], "namespace": namespace, "path": "/validate-pdcluster", "port": svc["spec"]["ports"][0]["port"],
    }  # fmt: skip
    # kopf serves a handler at /<id>: the path must be the id the operator registers.
    assert 'id="validate-pdcluster"' in WIRING.read_text()
    crd = yaml.safe_load(CRD_FILE.read_text())["spec"]
    (rule,) = hook["rules"]
    assert rule["apiGroups"] == [crd["group"]] and rule["resources"] == [crd["names"]["plural"]]
    assert rule["apiVersions"] == [v["name"] for v in crd["versions"]]
    if merged["operator"]["watchNamespaces"]:
        (expr,) = hook["namespaceSelector"]["matchExpressions"]
        assert expr["values"] == merged["operator"]["watchNamespaces"]

    if merged["webhook"]["certManager"]["enabled"]:
        assert "caBundle" not in hook["clientConfig"]
        cert = next(o for o in objs if o["kind"] == "Certificate")
        assert cert["apiVersion"] == CERT_MANAGER
        assert (
            vwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
            == f"{namespace}/{cert['metadata']['name']}"
        )
        assert cert["spec"]["secretName"] == secret
        assert f"{svc['metadata']['name']}.{namespace}.svc" in cert["spec"]["dnsNames"]
        issuers = [o for o in objs if o["kind"] == "Issuer"]
        if merged["webhook"]["certManager"]["issuerRef"]:
            assert not issuers and cert["spec"]["issuerRef"] == merged["webhook"]["certManager"]["issuerRef"]
        else:
            assert cert["spec"]["issuerRef"]["name"] == issuers[0]["metadata"]["name"] and issuers[0][
                "spec"
            ] == {"selfSigned": {}}
    else:
        assert hook["clientConfig"]["caBundle"] == merged["webhook"]["tls"]["caBundle"]
        assert not [o for o in objs if o["apiVersion"] == CERT_MANAGER]
    assert "validating webhook is on" in notes


def test_webhook_off_renders_no_admission_objects(chart: Any) -> None:
    objs, notes = _render(chart, {}, "tilert-system")
    assert not [
        o for o in objs if o["kind"] == "ValidatingWebhookConfiguration" or o["apiVersion"] == CERT_MANAGER
    ]
    (c,) = _one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert not [k for k in _env(c) if k.startswith("TILERT_PD_WEBHOOK")]
    assert "webhook" not in notes


def _all_namespaces_rules() -> list[dict[str, Any]]:
    """rbac.yaml's rules as bound when every namespace is watched: kopf observes namespaces only
    when it watches named ones, so that rule is left out."""
    return [r for r in yaml.safe_load(RBAC_FILE.read_text())["rules"] if "namespaces" not in r["resources"]]


def test_cluster_role_is_exactly_rbac_yaml(chart: Any) -> None:
    expected = _all_namespaces_rules()
    for case, (values, namespace) in MATRIX.items():
        if values.get("operator", {}).get("watchNamespaces"):
            continue  # the namespaced Role mode: test_named_namespaces_get_roles_and_no_cluster_wide_secrets
        objs, _ = _render(chart, values, namespace)
        roles = [o for o in objs if o["kind"] == "ClusterRole"]
        for role in roles:
            assert role["rules"] == expected, (
                f"{case}: ClusterRole differs from operator/tilert_operator/rbac.yaml"
            )
        assert roles or values.get("rbac", {}).get("create") is False
        assert not [o for o in objs if o["kind"] in ("Role", "RoleBinding")]


def test_named_namespaces_get_roles_and_no_cluster_wide_secrets(chart: Any) -> None:
    """operator.watchNamespaces: a Role and a RoleBinding in each watched namespace hold every
    namespaced rule of rbac.yaml; the ClusterRole keeps only the cluster-scoped ones (kopf's CRD and
    namespace discovery)."""
    expected = yaml.safe_load(RBAC_FILE.read_text())["rules"]
    objs, _ = _render(chart, {"operator": {"watchNamespaces": ["team-a", "team-b"]}}, "platform")
    cluster = _one(objs, "ClusterRole")
    assert [r["resources"] for r in cluster["rules"]] == [["customresourcedefinitions"], ["namespaces"]]
    assert not [r for r in cluster["rules"] if "secrets" in r["resources"]], "no cluster-wide Secret access"
    roles = {o["metadata"]["namespace"]: o for o in objs if o["kind"] == "Role"}
    bindings = {o["metadata"]["namespace"]: o for o in objs if o["kind"] == "RoleBinding"}
    assert sorted(roles) == sorted(bindings) == ["team-a", "team-b"]
    sa = _one(objs, "ServiceAccount")["metadata"]["name"]
    for ns, role in roles.items():
        # The Role and the ClusterRole together are exactly rbac.yaml, each in its order.
        assert role["rules"] == [r for r in expected if r not in cluster["rules"]], ns
        assert cluster["rules"] == [r for r in expected if r not in role["rules"]], ns
        b = bindings[ns]
        assert b["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": role["metadata"]["name"],
        }
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": "platform"}]
    crb = _one(objs, "ClusterRoleBinding")
    assert crb["roleRef"]["name"] == cluster["metadata"]["name"]
    for obj in objs:
        if obj["apiVersion"].startswith("rbac."):
            kubernetes_validate.validate(obj, K8S_VERSIONS[0], strict=True)
    # The operator is told the same namespaces it has rights in.
    args = _one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--namespace=")] == ["--namespace=team-a", "--namespace=team-b"]
    # rbac.create=false still renders no role at all.
    objs, _ = _render(chart, {"operator": {"watchNamespaces": ["a"]}, "rbac": {"create": False}}, "platform")
    assert not [o for o in objs if o["kind"] in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")]


def test_crd_is_byte_identical_to_the_one_source(chart: Any) -> None:
    (crd,) = chart.crds
    assert Path(crd["filename"]).name == "pdcluster.yaml"
    assert crd["data"].encode() == CRD_FILE.read_bytes()
    # One source, not a copy: crds/ and files/rbac.yaml in the chart are symlinks into the repo.
    assert (CHART_DIR / "crds").is_symlink() and (CHART_DIR / "crds").resolve() == CRD_FILE.parent
    assert (CHART_DIR / "files" / "rbac.yaml").resolve() == RBAC_FILE
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(yaml.safe_load(crd["data"]), version, strict=True)


def test_packaged_chart_carries_the_crd_and_rules(tmp_path: Path) -> None:
    # `helm package` follows the symlinks: the published .tgz must hold real copies of both files.
    archive = helm.package(CHART_DIR, destination=tmp_path)
    with helm.Chart.load_archive(Path(archive).read_bytes()) as packaged:
        (crd,) = packaged.crds
        assert crd["data"].encode() == CRD_FILE.read_bytes()
        objs, _ = _render(packaged, {}, "tilert-system")
        assert _one(objs, "ClusterRole")["rules"] == _all_namespaces_rules()


BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"operator": {"concurrency": 0}}, "/operator/concurrency"),
    ({"operator": {"resyncSeconds": 0}}, "/operator/resyncSeconds"),
    ({"operator": {"resyncSeconds": "30s"}}, "/operator/resyncSeconds"),
    ({"operator": {"logLevel": "verbose"}}, "/operator/logLevel"),
    ({"operator": {"watchNamespaces": ["Team_A"]}}, "/operator/watchNamespaces/0"),
    ({"operatr": {}}, "'operatr' not allowed"),
    ({"image": {"tag": "latest please"}}, "/image/tag"),
    ({"image": {"pullPolicy": "always"}}, "/image/pullPolicy"),
    ({"image": {"repository": ""}}, "/image/repository"),
    ({"metrics": {"port": 70000}}, "/metrics/port"),
    ({"webhook": {"enabled": True}}, "/webhook/tls/caBundle"),
    ({"webhook": {"enabled": True, "tls": {"caBundle": "not base64!"}}}, "/webhook/tls/caBundle"),
    ({"webhook": {"failurePolicy": "fail"}}, "/webhook/failurePolicy"),
    ({"webhook": {"timeoutSeconds": 60}}, "/webhook/timeoutSeconds"),
    (
        {"webhook": {"certManager": {"issuerRef": {"name": "x", "kind": "Vault"}}}},
        "/webhook/certManager/issuerRef/kind",
    ),
    ({"serviceAccount": {"create": False}}, "/serviceAccount/name"),
    ({"resources": {"requests": {"memory": "lots"}}}, "/resources/requests/memory"),
    ({"resources": {"request": {"cpu": "1"}}}, "'request' not allowed"),
]


@pytest.mark.parametrize(("values", "where"), BAD_VALUES, ids=[w for _, w in BAD_VALUES])
def test_bad_values_are_refused_by_the_schema_with_the_path(
    chart: Any, values: dict[str, Any], where: str
) -> None:
    with pytest.raises(helm.HelmValuesError) as schema_err:
        chart.validate_schema(values)
    assert where in str(schema_err.value)
    # An install renders too, and refuses the same values with the same message.
    with pytest.raises(helm.HelmValuesError) as render_err:
        chart.render(values, name="tpd", namespace="ops", is_install=True)
    assert where in str(render_err.value)


def test_notes_say_what_to_apply_and_how_to_watch(chart: Any) -> None:
    _, notes = _render(chart, {}, "tilert-system")
    assert "kubectl apply -f examples/tiny-cpu.yaml" in notes
    assert "kubectl get pdc -w" in notes and ".status.conditions" in notes
    assert "kubectl apply --server-side -f crds/pdcluster.yaml" in notes
    for path in re.findall(r"(examples/[\w.-]+\.yaml|crds/[\w.-]+\.yaml|docs/[\w.-]+\.md)", notes):
        assert (ROOT / path).is_file(), f"NOTES.txt names {path}, which does not exist"
    # The router Service and port NOTES.txt tells people to port-forward to.
    assert "service/tiny-router 8000:8000" in notes


def test_chart_version_and_default_image_follow_the_project(chart: Any) -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart.metadata["appVersion"] == project["version"]
    assert chart.values["image"]["repository"] == "ghcr.io/tilert-pd/operator"
    assert (ROOT / "docker" / "operator.Dockerfile").is_file()
