"""The chart's observability toggles, rendered with the real Helm engine: metrics.serviceMonitor,
metrics.podMonitor, metrics.prometheusRule and metrics.dashboards are off by default, each renders
its objects alone when on, and the objects hold the shapes the Prometheus operator's CRDs
(monitoring.coreos.com/v1) take.

Neither the repository nor the installed packages carry those CRDs, so `MONITORING_SCHEMAS` below
spells out, for each kind, the fields this chart uses with the types, enums and patterns the
published CRDs give them (prometheus-operator's example/prometheus-operator-crd/, v0.82), and refuses
any other field: a typo in a template fails here instead of being pruned by the API server. The
PodMonitors' selectors are checked against the pods the operator really renders (examples/)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tilert_operator import constants
from tilert_operator.render import all_manifests
from tilert_operator.spec import PDClusterSpec
from tilert_serve import observe
from tilert_serve.observe import paths

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "charts" / "tilert-pd"
MONITORING = "monitoring.coreos.com/v1"
KINDS = ("ServiceMonitor", "PodMonitor", "PrometheusRule")
TOGGLES = ("serviceMonitor", "podMonitor", "prometheusRule", "dashboards")
DASHBOARD_LABEL = "grafana_dashboard"

# The CRDs' duration pattern (monitoring.coreos.com Duration).
DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}


def _closed(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


LABEL_SELECTOR = _closed(
    {
        "matchLabels": STRING_MAP,
        "matchExpressions": {
            "type": "array",
            "items": _closed(
                {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
                ("key", "operator"),
            ),
        },
    }
)
NAMESPACE_SELECTOR = _closed(
    {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}
)
RELABELING = _closed(
    {
        "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}},
        "targetLabel": {"type": "string"},
        "replacement": {"type": "string"},
        "action": {
            "enum": [
                "replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod", "HashMod", "labelmap", "LabelMap",
                "labeldrop", "LabelDrop", "labelkeep", "LabelKeep", "lowercase", "Lowercase", "uppercase",
                "Uppercase", "keepequal", "KeepEqual", "dropequal", "DropEqual",
            ]
        },
    }
)  # fmt: skip
AUTHORIZATION = _closed(
    {
        "type": {"type": "string"},
        "credentials": _closed({"name": {"type": "string"}, "key": {"type": "string"}}, ("key",)),
    }
)
METADATA = _closed(
    {"name": {"type": "string", "maxLength": 63}, "namespace": {"type": "string"}, "labels": STRING_MAP},
    ("name", "namespace"),
)


def _object(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _closed(
        {"apiVersion": {"const": MONITORING}, "kind": {"const": kind}, "metadata": METADATA, "spec": spec},
        ("apiVersion", "kind", "metadata", "spec"),
    )


MONITORING_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": _object(
        "ServiceMonitor",
        _closed(
            {
                "jobLabel": {"type": "string"},
                "namespaceSelector": NAMESPACE_SELECTOR,
                "selector": LABEL_SELECTOR,
                "endpoints": {
                    "type": "array",
                    "items": _closed(
                        {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": DURATION},
                            "relabelings": {"type": "array", "items": RELABELING},
                        }
                    ),
                },
            },
            ("selector",),
        ),
    ),
    "PodMonitor": _object(
        "PodMonitor",
        _closed(
            {
                "jobLabel": {"type": "string"},
                "namespaceSelector": NAMESPACE_SELECTOR,
                "selector": LABEL_SELECTOR,
                "podMetricsEndpoints": {
                    "type": "array",
                    "items": _closed(
                        {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": DURATION},
                            "authorization": AUTHORIZATION,
                            "relabelings": {"type": "array", "items": RELABELING},
                        }
                    ),
                },
            },
            ("selector",),
        ),
    ),
    "PrometheusRule": _object(
        "PrometheusRule",
        _closed(
            {
                "groups": {
                    "type": "array",
                    "items": _closed(
                        {
                            "name": {"type": "string", "minLength": 1},
                            "interval": {"type": "string", "pattern": DURATION},
                            "rules": {
                                "type": "array",
                                "items": _closed(
                                    {
                                        "record": {"type": "string"},
                                        "alert": {"type": "string"},
                                        "expr": {"type": ["string", "integer"]},
                                        "for": {"type": "string", "pattern": DURATION},
                                        "labels": STRING_MAP,
                                        "annotations": STRING_MAP,
                                    },
                                    ("expr",),
                                ),
                            },
                        },
                        ("name",),
                    ),
                }
            }
        ),
    ),
}


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    import helm_python as helm

    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


def render(chart: Any, values: dict[str, Any], namespace: str = "ops") -> list[dict[str, Any]]:
    out = chart.render(values, name="tpd", namespace=namespace, is_install=True)
    return [
        o
        for path, text in out.items()
        if not path.endswith("NOTES.txt")
        for o in yaml.safe_load_all(text)
        if o
    ]


def metrics(**toggles: dict[str, Any]) -> dict[str, Any]:
    return {"metrics": toggles}


def observability_objects(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        o for o in objs if o["apiVersion"] == MONITORING or DASHBOARD_LABEL in o["metadata"].get("labels", {})
    ]


def validate(obj: dict[str, Any]) -> None:
    if obj["apiVersion"] == MONITORING:
        jsonschema.validate(obj, MONITORING_SCHEMAS[obj["kind"]])
    else:
        kubernetes_validate.validate(obj, "1.29.0", strict=True)


def test_all_off_by_default(chart: Any) -> None:
    defaults = yaml.safe_load((CHART_DIR / "values.yaml").read_text())["metrics"]
    assert all(defaults[t]["enabled"] is False for t in TOGGLES)
    assert observability_objects(render(chart, {})) == []


@pytest.mark.parametrize("toggle", TOGGLES)
def test_each_toggle_renders_its_objects_alone(chart: Any, toggle: str) -> None:
    objs = observability_objects(render(chart, metrics(**{toggle: {"enabled": True}})))
    expected = {
        "serviceMonitor": ["ServiceMonitor"],
        "podMonitor": ["PodMonitor", "PodMonitor"],
        "prometheusRule": ["PrometheusRule"],
        "dashboards": ["ConfigMap"] * len(paths.dashboards()),
    }[toggle]
    assert sorted(o["kind"] for o in objs) == expected
    for obj in objs:
        validate(obj)
        assert obj["metadata"]["namespace"] == "ops"


def test_everything_on_validates(chart: Any) -> None:
    values = metrics(
        serviceMonitor={"enabled": True, "interval": "1m", "labels": {"release": "kps"}},
        podMonitor={
            "enabled": True,
            "labels": {"release": "kps"},
            "router": {"authorization": {"secretName": "router-scrape-key", "key": "token"}},
        },
        prometheusRule={"enabled": True, "labels": {"release": "kps"}},
        dashboards={"enabled": True, "namespace": "grafana", "annotations": {"grafana_folder": "tilert-pd"}},
    )
    objs = observability_objects(render(chart, values))
    assert len(objs) == 4 + len(paths.dashboards())
    for obj in objs:
        validate(obj)
        if obj["apiVersion"] == MONITORING:
            assert obj["metadata"]["labels"]["release"] == "kps"


def test_schema_check_catches_a_wrong_field(chart: Any) -> None:
    # The hand-written schema can fail: a misspelt field, a bad interval.
    (pm, _) = [o for o in render(chart, metrics(podMonitor={"enabled": True})) if o["kind"] == "PodMonitor"]
    bad = yaml.safe_load(yaml.safe_dump(pm))
    bad["spec"]["podMetricsEndpoints"][0]["bearerTokenSecrett"] = {"name": "x", "key": "y"}
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)
    bad = yaml.safe_load(yaml.safe_dump(pm))
    bad["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


def _operator_pods() -> list[tuple[str, dict[str, str], set[str]]]:
    """(component, pod labels, container port names) of every workload the operator renders for the
    examples' PDClusters."""
    out = []
    for example in ("tiny-cpu.yaml", "glm5-b200-rdma.yaml"):
        doc = next(
            d
            for d in yaml.safe_load_all((ROOT / "examples" / example).read_text())
            if d and d["kind"] == "PDCluster"
        )
        spec = PDClusterSpec.model_validate(doc["spec"])
        for m in all_manifests(spec, doc["metadata"]["name"], "serving", secret_token="t"):
            template = m.get("spec", {}).get("template")
            if template:
                labels = template["metadata"]["labels"]
                ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
                out.append((labels[constants.LABEL_COMPONENT], labels, ports))
    return out


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In", e
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


def test_pod_monitors_select_every_serving_pod_the_operator_renders_once(chart: Any) -> None:
    monitors = [o for o in render(chart, metrics(podMonitor={"enabled": True})) if o["kind"] == "PodMonitor"]
    pods = _operator_pods()
    assert {c for c, _, _ in pods} == set(constants.COMPONENTS)
    for component, labels, ports in pods:
        chosen = [m for m in monitors if _selects(m["spec"]["selector"], labels)]
        assert len(chosen) == 1, f"{component}: selected by {[m['metadata']['name'] for m in chosen]}"
        (m,) = chosen
        assert m["metadata"]["name"].endswith("-router") == (component == constants.ROUTER)
        endpoint = m["spec"]["podMetricsEndpoints"][0]
        assert endpoint["port"] in ports, f"{component}: no container port named {endpoint['port']}"
        # The job is the component (as the rules and the local Prometheus name it); pdcluster the cluster.
        assert m["spec"]["jobLabel"] == constants.LABEL_COMPONENT
        (relabel,) = endpoint["relabelings"]
        meta = "__meta_kubernetes_pod_label_" + constants.LABEL_CLUSTER.replace(".", "_").replace("/", "_")
        assert relabel == {"sourceLabels": [meta], "targetLabel": "pdcluster", "action": "replace"}
        assert constants.LABEL_CLUSTER in labels
    # A pod of anything else in the namespace is not scraped.
    assert not any(_selects(m["spec"]["selector"], {"app": "something-else"}) for m in monitors)


def test_pod_monitor_namespaces_and_router_credential(chart: Any) -> None:
    def monitors(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {
            o["metadata"]["name"].rsplit("-", 1)[1]: o["spec"]
            for o in render(chart, values)
            if o["kind"] == "PodMonitor"
        }

    plain = monitors(metrics(podMonitor={"enabled": True}))
    assert plain["router"]["namespaceSelector"] == {"any": True}
    assert all("authorization" not in e for m in plain.values() for e in m["podMetricsEndpoints"])

    watched = monitors({"operator": {"watchNamespaces": ["a", "b"]}, **metrics(podMonitor={"enabled": True})})
    assert watched["pools"]["namespaceSelector"] == {"matchNames": ["a", "b"]}
    named = monitors(
        {
            "operator": {"watchNamespaces": ["a", "b"]},
            **metrics(
                podMonitor={
                    "enabled": True,
                    "namespaces": ["c"],
                    "router": {"authorization": {"secretName": "k"}},
                }
            ),
        }
    )
    assert named["router"]["namespaceSelector"] == {"matchNames": ["c"]}
    assert named["router"]["podMetricsEndpoints"][0]["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "k", "key": "key"},
    }
    # Only the router's /metrics takes a key: the nodes' and vLLM's are open.
    assert "authorization" not in named["pools"]["podMetricsEndpoints"][0]


def test_service_monitor_selects_the_metrics_service(chart: Any) -> None:
    objs = render(chart, metrics(serviceMonitor={"enabled": True}))
    (sm,) = [o for o in objs if o["kind"] == "ServiceMonitor"]
    services = [
        o
        for o in objs
        if o["kind"] == "Service" and _selects(sm["spec"]["selector"], o["metadata"]["labels"])
    ]
    with_port = [
        s for s in services if sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in s["spec"]["ports"]}
    ]
    assert [s["metadata"]["name"] for s in with_port] == ["tpd-tilert-pd-metrics"]
    # The job is the one the rules and the local Prometheus name.
    assert sm["spec"]["endpoints"][0]["relabelings"] == [
        {"targetLabel": "job", "replacement": "tilert-pd-operator", "action": "replace"}
    ]
    assert "tilert-pd-operator" in observe.JOBS


def test_service_monitor_without_the_metrics_service_is_refused(chart: Any) -> None:
    import helm_python as helm

    for off in ({"enabled": False}, {"service": {"enabled": False}}):
        with pytest.raises(helm.HelmError) as err:
            render(chart, {"metrics": {"serviceMonitor": {"enabled": True}, **off}})
        assert "metrics.service.enabled" in str(err.value)


def test_prometheus_rule_is_the_rule_file(chart: Any) -> None:
    (rule,) = [
        o for o in render(chart, metrics(prometheusRule={"enabled": True})) if o["kind"] == "PrometheusRule"
    ]
    assert rule["spec"] == yaml.safe_load(paths.rules_file().read_text())


def test_dashboards_are_configmaps_for_the_sidecar(chart: Any) -> None:
    values = metrics(
        dashboards={"enabled": True, "label": "my_dashboards", "labelValue": "yes", "namespace": "grafana"}
    )
    maps = [o for o in render(chart, values) if o["kind"] == "ConfigMap"]
    assert len(maps) == len(paths.dashboards())
    for cm, path in zip(sorted(maps, key=lambda m: m["metadata"]["name"]), paths.dashboards(), strict=True):
        assert cm["metadata"]["labels"]["my_dashboards"] == "yes"
        assert cm["metadata"]["namespace"] == "grafana"
        assert cm["data"] == {path.name: path.read_text().rstrip("\n")}
        validate(cm)


def test_values_schema_refuses_a_misspelt_toggle(chart: Any) -> None:
    import helm_python as helm

    for values, where in (
        (metrics(podMonitor={"enable": True}), "enable"),
        (metrics(serviceMonitor={"enabled": True, "interval": "30 seconds"}), "interval"),
        (metrics(dashboards={"enabled": "yes"}), "enabled"),
    ):
        with pytest.raises(helm.HelmValuesError) as err:
            chart.validate_schema(values)
        assert where in str(err.value)


def test_lint_strict_with_everything_on() -> None:
    import helm_python as helm

    values = metrics(
        serviceMonitor={"enabled": True},
        podMonitor={"enabled": True, "router": {"authorization": {"secretName": "k"}}},
        prometheusRule={"enabled": True},
        dashboards={"enabled": True},
    )
    report = helm.lint(CHART_DIR, values, strict=True, namespace="ops", kube_version="v1.29.0")
    # Severity 1 is informational ("icon is recommended"); strict lint turns warnings into errors.
    problems = [m for m in report["messages"] if m["severity"] > 1]
    assert not report["errors"] and not problems, report
