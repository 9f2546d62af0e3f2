"""Kubernetes API semantics the test server needs, as plain functions: merge and JSON patches,
label and field selectors, the JSONPath subset of printer columns, and the API's error type."""

from __future__ import annotations

import copy
import json
import re
from fractions import Fraction
from typing import Any

Obj = dict[str, Any]


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
        #: status.details of the answer (a 422's causes), when there are any.
        self.details: Obj | None = None


def merge(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge(out.get(k), v)
    return out


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def json_patch(obj: Obj, ops: list[Obj]) -> Obj:
    obj = copy.deepcopy(obj)
    for op in ops:
        parts = _pointer(op["path"])
        parent: Any = obj
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent.setdefault(p, {})
        last = parts[-1]
        kind = op["op"]
        if kind == "test":
            current = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if current != op.get("value"):
                raise ApiError(422, "Invalid", f"the JSON-patch test at {op['path']} failed")
        elif kind in ("add", "replace"):
            if isinstance(parent, list):
                if last == "-":
                    parent.append(op["value"])
                elif kind == "add":
                    parent.insert(int(last), op["value"])
                else:
                    parent[int(last)] = op["value"]
            else:
                parent[last] = op["value"]
        elif kind == "remove":
            if isinstance(parent, list):
                parent.pop(int(last))
            else:
                parent.pop(last, None)
        else:
            raise ApiError(422, "Invalid", f"unsupported JSON-patch op {kind}")
    return obj


_SEL = re.compile(r"^\s*(!?)([\w./-]+)\s*(?:(==|=|!=)\s*([\w./-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*$")


def _split_selector(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [*out, cur] if cur.strip() else out


def label_match(selector: str | None, labels: dict[str, str]) -> bool:
    for term in _split_selector(selector or ""):
        m = _SEL.match(term)
        if not m:
            raise ApiError(400, "BadRequest", f"unable to parse label selector term {term!r}")
        neg, key, op, value, setop, values = m.groups()
        if setop:
            vals = {v.strip() for v in values.split(",")}
            ok = labels.get(key) in vals if setop == "in" else labels.get(key) not in vals
        elif op in ("=", "=="):
            ok = labels.get(key) == value
        elif op == "!=":
            ok = labels.get(key) != value
        else:
            ok = key in labels
        if neg:
            ok = not ok
        if not ok:
            return False
    return True


def field_match(selector: str | None, obj: Obj) -> bool:
    for term in _split_selector(selector or ""):
        key, op, value = re.split(r"(!=|==|=)", term.strip(), maxsplit=1)
        node: Any = obj
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        ok = str(node or "") == value
        if (op == "!=") == ok:
            return False
    return True


def jsonpath(obj: Obj, path: str) -> Any:
    """The JSONPath subset printer columns use: .a.b and .list[?(@.k=="v")].field."""
    node: Any = obj
    for part in re.findall(r"\.([\w-]+)(\[\?\(@\.(\w+)==\"([^\"]*)\"\)\])?", path):
        name, has_filter, fkey, fval = part
        node = node.get(name) if isinstance(node, dict) else None
        if has_filter:
            node = next((i for i in node or [] if isinstance(i, dict) and i.get(fkey) == fval), None)
    return node


# ---- a real API server's strictness: names, labels, quantities, built-in kinds' rules ------------
#
# What kube-apiserver v1.32 does that our code depends on, with its messages and Status shapes
# (k8s.io/apimachinery/pkg/util/validation, pkg/apis/{core,apps,networking}/validation,
# k8s.io/apimachinery/pkg/api/resource). Each rule here is one the operator once broke.


class Cause:
    """One entry of a 422's status.details.causes (metav1.StatusCause), as field.Error renders it."""

    def __init__(self, field: str, kind: str, message: str, value: Any = None) -> None:
        self.field, self.kind, self.detail, self.value = field, kind, message, value

    @property
    def reason(self) -> str:
        return {
            "Invalid": "FieldValueInvalid",
            "Required": "FieldValueRequired",
            "NotFound": "FieldValueNotFound",
            "NotSupported": "FieldValueNotSupported",
            "Duplicate": "FieldValueDuplicate",
            "TooLong": "FieldValueTooLong",
            "Forbidden": "FieldValueForbidden",
        }[self.kind]

    @property
    def message(self) -> str:
        """field.Error.ErrorBody(): `Invalid value: "x": detail`, `Required value: detail`, ..."""
        head = {
            "Invalid": "Invalid value",
            "Required": "Required value",
            "NotFound": "Not found",
            "NotSupported": "Unsupported value",
            "Duplicate": "Duplicate value",
            "TooLong": "Too long",
            "Forbidden": "Forbidden",
        }[self.kind]
        if self.kind in ("Invalid", "NotFound", "NotSupported", "Duplicate"):
            head += f": {go_value(self.value)}"
        return f"{head}: {self.detail}" if self.detail else head

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def go_value(v: Any) -> str:
    """A value as field.Error prints it (%#v for strings and maps, %d for numbers)."""
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return (
            "map[string]string{"
            + ", ".join(f"{json.dumps(k)}:{json.dumps(str(x))}" for k, x in sorted(v.items()))
            + "}"
        )
    return str(v)


class InvalidError(ApiError):
    """422 Invalid with the causes a real API server lists (StatusReasonInvalid)."""

    def __init__(self, kind: str, group: str, name: str, causes: list[Cause]) -> None:
        qualified = f"{kind}.{group}" if group else kind
        errs = [str(c) for c in causes]
        text = errs[0] if len(errs) == 1 else "[" + ", ".join(errs) + "]"
        super().__init__(422, "Invalid", f'{qualified} "{name}" is invalid: {text}')
        self.details = {
            "name": name,
            "group": group,
            "kind": kind,
            "causes": [{"reason": c.reason, "message": c.message, "field": c.field} for c in causes],
        }
        if not group:
            del self.details["group"]


DNS1123_LABEL = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_SUBDOMAIN = DNS1123_LABEL + r"(\." + DNS1123_LABEL + ")*"
DNS1035_LABEL = "[a-z]([-a-z0-9]*[a-z0-9])?"
LABEL_VALUE = "(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?"
QUALIFIED_NAME = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
ENV_VAR_NAME = "[-._a-zA-Z][-._a-zA-Z0-9]*"  # v1.32 (RelaxedEnvironmentVariableValidation off)
CONFIG_MAP_KEY = "[-._a-zA-Z0-9]+"
IANA_SVC_NAME = "[-a-z0-9]+"
#: The StatefulSet controller labels each pod `controller-revision-hash: <statefulset name>-<hash>`,
#: the hash being a 32-bit FNV hash in Kubernetes' safe alphabet (up to 10 characters). A label value
#: holds at most 63 characters, so a StatefulSet whose name is longer than 63 - 1 - 10 = 52 has pods
#: the API server refuses: the controller can never create one.
STATEFULSET_NAME_MAX = 63 - 1 - 10


def _full(pattern: str, text: str) -> bool:
    return re.fullmatch(pattern, text) is not None


def _length_and_form(v: str, most: int, pattern: str, form: str) -> list[str]:
    """The API server's two checks of a name or value, in its order and words: its length, then its
    form (`form`: what it says when `pattern` does not match)."""
    out = [f"must be no more than {most} characters"] if len(v) > most else []
    if not _full(pattern, v):
        out.append(form)
    return out


def dns1123_label(v: str) -> list[str]:
    return _length_and_form(
        v,
        63,
        DNS1123_LABEL,
        "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and "
        f"end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '{DNS1123_LABEL}')",
    )


def dns1123_subdomain(v: str) -> list[str]:
    return _length_and_form(
        v,
        253,
        DNS1123_SUBDOMAIN,
        "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
        f"start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '{DNS1123_SUBDOMAIN}')",
    )


def dns1035_label(v: str) -> list[str]:
    return _length_and_form(
        v,
        63,
        DNS1035_LABEL,
        "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic "
        f"character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for validation is '{DNS1035_LABEL}')",
    )


def label_value(v: str) -> list[str]:
    return _length_and_form(
        v,
        63,
        LABEL_VALUE,
        "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must "
        "start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for "
        f"validation is '{LABEL_VALUE}')",
    )


def qualified_name(v: str) -> list[str]:
    prefix, _, name = v.rpartition("/")
    out = []
    if "/" in v:
        if not prefix:
            out.append("prefix part must be non-empty")
        else:
            out += ["prefix part " + m for m in dns1123_subdomain(prefix)]
    if not name:
        out.append("name part must be non-empty")
    elif len(name) > 63:
        out.append("name part must be no more than 63 characters")
    if name and not _full(QUALIFIED_NAME, name):
        out.append(
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
            "alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
            f"'{QUALIFIED_NAME}')"
        )
    return out


def env_var_name(v: str) -> list[str]:
    if _full(ENV_VAR_NAME, v):
        return []
    return [
        "a valid environment variable name must consist of alphabetic characters, digits, '_', '-', or '.', and must not "
        f"start with a digit (e.g. 'my.env-name',  or 'MY_ENV.NAME',  or 'MyEnvName1', regex used for validation is '{ENV_VAR_NAME}')"
    ]


# ---- quantities (k8s.io/apimachinery/pkg/api/resource) -------------------------------------------

QUANTITY_PATTERN = "^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
_BIN = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DEC = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DEC_SUFFIX = {e: s for s, e in _DEC.items()}
_BIN_SUFFIX = {e: s for s, e in _BIN.items()} | {0: ""}


class QuantityError(ValueError):
    pass


def parse_quantity(text: Any) -> tuple[Fraction, str]:
    """(value, format) as resource.ParseQuantity reads it: format is DecimalSI, BinarySI or
    DecimalExponent, from the suffix. Integers (JSON numbers) are DecimalSI."""
    if isinstance(text, bool):
        raise QuantityError("quantities must match the regular expression '" + QUANTITY_PATTERN + "'")
    if isinstance(text, int):
        return Fraction(text), "DecimalSI"
    if isinstance(text, float):
        text = repr(text)
    m = re.fullmatch(r"([+-]?)([0-9]*)(?:\.([0-9]*))?(.*)", str(text))
    if not str(text) or m is None or not (m.group(2) or m.group(3)):
        raise QuantityError("quantities must match the regular expression '" + QUANTITY_PATTERN + "'")
    sign, whole, frac, suffix = m.groups()
    value = Fraction(int(whole or "0")) + (Fraction(int(frac), 10 ** len(frac)) if frac else 0)
    if suffix in _BIN:
        value, fmt = value * 2 ** _BIN[suffix], "BinarySI"
    elif suffix in _DEC:
        value, fmt = value * Fraction(10) ** _DEC[suffix], "DecimalSI"
    elif re.fullmatch(r"[eE][+-]?[0-9]+", suffix):
        value, fmt = value * Fraction(10) ** int(suffix[1:]), "DecimalExponent"
    else:
        raise QuantityError("unable to parse quantity's suffix")
    return (-value if sign == "-" else value), fmt


def canonical_quantity(text: Any) -> str:
    """Quantity.String(): what the API server stores for a quantity the client wrote.

    Values round up (away from zero) to a nano; BinarySI stays binary only for whole values of at
    least 1024 (else DecimalSI); decimal forms drop trailing zeros and take the largest exponent
    that is a multiple of 3 and keeps the mantissa whole (`0.5` -> `500m`, `1000m` -> `1`,
    `2000` -> `2k`, `1.5Gi` -> `1536Mi`, `12e6` -> `12e6`)."""
    value, fmt = parse_quantity(text)
    if value == 0:
        return "0"
    sign = "-" if value < 0 else ""
    nanos = -((-abs(value) * 10**9) // 1)  # ceil: never round a non-zero request down to nothing
    value = Fraction(nanos, 10**9)
    if fmt == "BinarySI" and (value < 1024 or value.denominator != 1):
        fmt = "DecimalSI"
    if fmt == "BinarySI":
        mantissa, exp = int(value), 0
        while mantissa % 1024 == 0 and exp < 60:
            mantissa, exp = mantissa // 1024, exp + 10
        return f"{sign}{mantissa}{_BIN_SUFFIX[exp]}"
    mantissa, exp = nanos, -9
    while mantissa % 10 == 0:
        mantissa, exp = mantissa // 10, exp + 1
    if exp % 3:
        mantissa, exp = mantissa * 10 ** (exp % 3), exp - exp % 3
    if fmt == "DecimalExponent" or exp not in _DEC_SUFFIX:
        return f"{sign}{mantissa}" + (f"e{exp}" if exp else "")
    return f"{sign}{mantissa}{_DEC_SUFFIX[exp]}"


def _quantity_maps(obj: Obj) -> list[tuple[str, dict[str, Any]]]:
    """Every map of quantities in a built-in object (path, map): resources' requests and limits of
    every container, volume claim templates' requests, pod overhead."""
    out: list[tuple[str, dict[str, Any]]] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                p = f"{path}.{k}" if path else k
                if k in ("requests", "limits") and path.endswith("resources") and isinstance(v, dict):
                    out.append((p, v))
                elif k == "overhead" and isinstance(v, dict):
                    out.append((p, v))
                else:
                    walk(v, p)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")

    walk(obj, "")
    return out


def _size_limits(obj: Obj) -> list[tuple[dict[str, Any], str]]:
    out: list[tuple[dict[str, Any], str]] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            if "sizeLimit" in node and path.endswith("emptyDir"):
                out.append((node, f"{path}.sizeLimit"))
            for k, v in node.items():
                walk(v, f"{path}.{k}" if path else k)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")

    walk(obj, "")
    return out


def canonicalise(kind: str, obj: Obj) -> list[Cause]:
    """Store quantities as the API server does (canonical strings), in place. A quantity that does not
    parse fails decoding (400, raised); a negative one is a cause for the 422."""
    causes: list[Cause] = []
    holders: list[tuple[dict[str, Any], str, str]] = [
        (m, k, f"{p}[{k}]") for p, m in _quantity_maps(obj) for k in list(m)
    ]
    holders += [(node, "sizeLimit", p) for node, p in _size_limits(obj)]
    for holder, key, path in holders:
        try:
            value, _ = parse_quantity(holder[key])
        except QuantityError as e:
            raise ApiError(
                400, "BadRequest", f'{kind} in version "v1" cannot be handled as a {kind}: {e}'
            ) from e
        if value < 0:
            causes.append(
                Cause(path, "Invalid", "must be greater than or equal to 0", canonical_quantity(holder[key]))
            )
        holder[key] = canonical_quantity(holder[key])
    return causes


#: Map-typed fields: their entries are data, kept even when empty ("" label values, "" ConfigMap values).
_MAP_FIELDS = frozenset(
    {
        "labels",
        "annotations",
        "data",
        "stringData",
        "binaryData",
        "nodeSelector",
        "matchLabels",
        "selector",
        "limits",
        "requests",
        "overhead",
    }
)


def drop_empty(node: Any) -> Any:
    """What a real API server returns for fields the client sent empty: the Go types mark optional
    fields `omitempty`, so an empty string or list the client wrote (an env var's `value: ""`, `args: []`)
    is not there when the object is read back, nor is an empty map (`limits: {}`, `labels: {}`).
    (Empty objects are kept: `emptyDir: {}` means something;
    false booleans too: many are pointers.)"""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k in _MAP_FIELDS and isinstance(v, dict):
                if v:  # an empty Go map is omitted like an empty string (`limits: {}` reads back absent)
                    out[k] = v
            elif v == "" or v == []:
                continue
            else:
                out[k] = drop_empty(v)
        return out
    if isinstance(node, list):
        return [drop_empty(v) for v in node]
    return node


def _meta_causes(kind: str, obj: Obj) -> list[Cause]:
    meta = obj.get("metadata") or {}
    name = meta.get("name") or ""
    rule = {"Service": dns1035_label, "Namespace": dns1123_label}.get(kind, dns1123_subdomain)
    causes = [Cause("metadata.name", "Invalid", m, name) for m in rule(name)]
    if kind == "StatefulSet" and len(name) > STATEFULSET_NAME_MAX:
        # Not refused by a real API server: its StatefulSet controller then fails to create every
        # pod (their controller-revision-hash label would exceed 63 characters). This server plays
        # no controllers, so it refuses here, where the test can see it.
        causes.append(
            Cause(
                "metadata.name",
                "Invalid",
                f"must be no more than {STATEFULSET_NAME_MAX} characters (test server: the StatefulSet controller "
                "labels each pod controller-revision-hash=<name>-<10-character hash>, and a label value "
                "holds 63; a real API server accepts the StatefulSet and no pod is ever created)",
                name,
            )
        )
    causes += _label_causes(meta.get("labels"), "metadata.labels")
    for key in meta.get("annotations") or {}:
        causes += [Cause("metadata.annotations", "Invalid", m, key) for m in qualified_name(key)]
    return causes


def _label_causes(labels: Any, path: str) -> list[Cause]:
    causes: list[Cause] = []
    for k, v in (labels or {}).items():
        causes += [Cause(path, "Invalid", m, k) for m in qualified_name(k)]
        causes += [Cause(f"{path}", "Invalid", m, v) for m in label_value(str(v))]
    return causes


def _selector_causes(sel: Any, path: str) -> list[Cause]:
    if not isinstance(sel, dict):
        return []
    causes = _label_causes(sel.get("matchLabels"), f"{path}.matchLabels")
    for i, expr in enumerate(sel.get("matchExpressions") or []):
        causes += [
            Cause(f"{path}.matchExpressions[{i}].key", "Invalid", m, expr.get("key", ""))
            for m in qualified_name(expr.get("key", ""))
        ]
    return causes


def _pod_spec_causes(spec: Any, path: str) -> list[Cause]:
    if not isinstance(spec, dict):
        return []
    causes: list[Cause] = []
    volumes = set()
    for i, vol in enumerate(spec.get("volumes") or []):
        name = vol.get("name", "")
        causes += [Cause(f"{path}.volumes[{i}].name", "Invalid", m, name) for m in dns1123_label(name)]
        if name in volumes:
            causes.append(Cause(f"{path}.volumes[{i}].name", "Duplicate", "", name))
        volumes.add(name)
    for group in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(group) or []):
            cpath = f"{path}.{group}[{i}]"
            causes += [
                Cause(f"{cpath}.name", "Invalid", m, c.get("name", ""))
                for m in dns1123_label(c.get("name", ""))
            ]
            if not c.get("image"):
                causes.append(Cause(f"{cpath}.image", "Required", ""))
            for j, env in enumerate(c.get("env") or []):
                causes += [
                    Cause(f"{cpath}.env[{j}].name", "Invalid", m, env.get("name", ""))
                    for m in env_var_name(env.get("name", ""))
                ]
            for j, mount in enumerate(c.get("volumeMounts") or []):
                if mount.get("name") not in volumes:
                    causes.append(Cause(f"{cpath}.volumeMounts[{j}].name", "NotFound", "", mount.get("name")))
            for j, port in enumerate(c.get("ports") or []):
                n = port.get("name")
                if n is not None and not (len(n) <= 15 and _full(IANA_SVC_NAME, n) and re.search("[a-z]", n)):
                    causes.append(
                        Cause(
                            f"{cpath}.ports[{j}].name",
                            "Invalid",
                            "must be no more than 15 characters and contain "
                            "only lowercase letters, digits and '-', with at least one letter",
                            n,
                        )
                    )
            res = c.get("resources") or {}
            for rname, limit in (res.get("limits") or {}).items():
                req = (res.get("requests") or {}).get(rname)
                if req is not None and parse_quantity(req)[0] > parse_quantity(limit)[0]:
                    causes.append(
                        Cause(
                            f"{cpath}.resources.requests",
                            "Invalid",
                            f"must be less than or equal to {rname} limit of {limit}",
                            req,
                        )
                    )
    causes += _label_causes(spec.get("nodeSelector"), f"{path}.nodeSelector")
    for i, tol in enumerate(spec.get("tolerations") or []):
        if tol.get("operator") == "Exists" and tol.get("value"):
            causes.append(
                Cause(
                    f"{path}.tolerations[{i}].operator",
                    "Invalid",
                    "value must be empty when `operator` is 'Exists'",
                    tol.get("value"),
                )
            )
        if tol.get("operator") not in (None, "", "Exists", "Equal"):
            causes.append(
                Cause(
                    f"{path}.tolerations[{i}].operator",
                    "NotSupported",
                    'supported values: "Equal", "Exists"',
                    tol.get("operator"),
                )
            )
    return causes


def _workload_causes(obj: Obj) -> list[Cause]:
    spec = obj.get("spec") or {}
    causes: list[Cause] = []
    sel = spec.get("selector")
    template = spec.get("template") or {}
    tlabels = (template.get("metadata") or {}).get("labels") or {}
    if not sel:
        causes.append(Cause("spec.selector", "Required", ""))
    elif not sel.get("matchLabels") and not sel.get("matchExpressions"):
        causes.append(Cause("spec.selector", "Invalid", "empty selector is invalid for deployment", sel))
    else:
        causes += _selector_causes(sel, "spec.selector")
        if any(tlabels.get(k) != v for k, v in (sel.get("matchLabels") or {}).items()):
            causes.append(
                Cause(
                    "spec.template.metadata.labels",
                    "Invalid",
                    "`selector` does not match template `labels`",
                    tlabels,
                )
            )
    causes += _label_causes(tlabels, "spec.template.metadata.labels")
    if (spec.get("replicas") or 0) < 0:
        causes.append(
            Cause("spec.replicas", "Invalid", "must be greater than or equal to 0", spec.get("replicas"))
        )
    causes += _pod_spec_causes(template.get("spec"), "spec.template.spec")
    return causes


def _service_causes(obj: Obj) -> list[Cause]:
    spec = obj.get("spec") or {}
    causes = _label_causes(spec.get("selector"), "spec.selector")
    ports = spec.get("ports") or []
    for i, port in enumerate(ports):
        if len(ports) > 1 and not port.get("name"):
            causes.append(Cause(f"spec.ports[{i}].name", "Required", ""))
        if not 1 <= int(port.get("port") or 0) <= 65535:
            causes.append(
                Cause(
                    f"spec.ports[{i}].port",
                    "Invalid",
                    "must be between 1 and 65535, inclusive",
                    port.get("port"),
                )
            )
    return causes


def _network_policy_causes(obj: Obj) -> list[Cause]:
    spec = obj.get("spec") or {}
    causes = _selector_causes(spec.get("podSelector"), "spec.podSelector")
    for direction, peers_key in (("ingress", "from"), ("egress", "to")):
        for i, rule in enumerate(spec.get(direction) or []):
            for j, peer in enumerate(rule.get(peers_key) or []):
                path = f"spec.{direction}[{i}].{peers_key}[{j}]"
                if not any(peer.get(k) is not None for k in ("podSelector", "namespaceSelector", "ipBlock")):
                    causes.append(Cause(path, "Required", "must specify a peer"))
                for k in ("podSelector", "namespaceSelector"):
                    causes += _selector_causes(peer.get(k), f"{path}.{k}")
    return causes


def _data_key_causes(obj: Obj) -> list[Cause]:
    causes: list[Cause] = []
    for section in ("data", "binaryData", "stringData"):
        for key in obj.get(section) or {}:
            if not _full(CONFIG_MAP_KEY, key) or len(key) > 253:
                causes.append(
                    Cause(
                        f"{section}[{key}]",
                        "Invalid",
                        f"a valid config key must consist of alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  "
                        f"or 'KEY_NAME',  or 'key-name', regex used for validation is '{CONFIG_MAP_KEY}')",
                        key,
                    )
                )
    return causes


KIND_RULES = {
    "Deployment": _workload_causes,
    "StatefulSet": _workload_causes,
    "Service": _service_causes,
    "NetworkPolicy": _network_policy_causes,
    "ConfigMap": _data_key_causes,
    "Secret": _data_key_causes,
    "Pod": lambda o: _pod_spec_causes(o.get("spec"), "spec"),
}


def builtin_causes(kind: str, obj: Obj) -> list[Cause]:
    """The 422 causes a real API server finds in a built-in object (after canonicalise)."""
    rules = KIND_RULES.get(kind)
    return _meta_causes(kind, obj) + (rules(obj) if rules else [])


# ---- server-side apply's typed conversion (the built-in kinds' OpenAPI schemas) -----------------

_SCHEMA_VERSION = "1.32.0"


def _schema_validator(kind: str, api_version: str, strict: bool) -> Any:
    key = (kind, api_version, strict)
    if key not in _VALIDATORS:
        import jsonschema
        from kubernetes_validate import utils as kv
        from referencing import Registry, Resource

        group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
        schema_dir = f"v{_SCHEMA_VERSION}-local" + ("-strict" if strict else "")
        try:
            schema = kv.schema_contents(
                f"kubernetes-json-schema/{schema_dir}/{kind.lower()}-{group_version}.json", _SCHEMA_VERSION
            )
        except FileNotFoundError:
            _VALIDATORS[key] = None
            return None
        defs = kv.schema_contents(f"kubernetes-json-schema/{schema_dir}/_definitions.json", _SCHEMA_VERSION)
        inlined = _inline(schema, defs["$defs"], ())
        registry: Any = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
        # $refs inlined once where they do not recurse: reference resolution dominated the cost.
        _VALIDATORS[key] = jsonschema.Draft202012Validator(inlined, registry=registry)
    return _VALIDATORS[key]


_VALIDATORS: dict[tuple[str, str, bool], Any] = {}


def _inline(node: Any, defs: dict[str, Any], seen: tuple[str, ...]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and "#/$defs/" in ref:
            name = ref.split("#/$defs/", 1)[1]
            if name in seen or name not in defs:
                return node  # recursive (JSONSchemaProps): left to the registry
            return _inline(defs[name], defs, (*seen, name)) | {k: v for k, v in node.items() if k != "$ref"}
        return {k: _inline(v, defs, seen) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs, seen) for v in node]
    return node


def schema_error(validator: Any, obj: Obj) -> Any:
    """The shallowest schema error, ignoring `required` (an applied configuration may be partial;
    missing required fields are validation's 422, not a decoding error)."""
    errors = [e for e in validator.iter_errors(obj) if e.validator != "required"]
    return min(errors, key=lambda e: len(e.absolute_path), default=None)


def decode_error(kind: str, api_version: str, obj: Obj) -> ApiError | None:
    """Create, update and merge patches decode the body into the kind's Go type: a wrong type fails
    there, answered 400 (unknown fields are dropped with a warning: fieldValidation defaults to Warn)."""
    validator = _schema_validator(kind, api_version, strict=False)
    err = schema_error(validator, obj) if validator is not None else None
    if err is None:
        return None
    version = api_version.rsplit("/", 1)[-1]
    return ApiError(
        400,
        "BadRequest",
        f'{kind} in version "{version}" cannot be handled as a {kind}: '
        f"{_schema_path(err.absolute_path).lstrip('.')}: {err.message}",
    )


def _schema_path(parts: Any) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def typed_patch_error(
    kind: str, api_version: str, namespace: str | None, name: str, body: Obj
) -> ApiError | None:
    """Server-side apply converts the applied object to its kind's schema first: an unknown field, a
    wrong type, or two entries with one key in a keyed list (env by name, containers by name, ports
    by containerPort) fails there, before validation, as a plain error, which the API server answers
    500 (kubernetes/kubernetes#118476) with this message."""
    where = f"failed to create typed patch object ({namespace + '/' if namespace else ''}{name}; {api_version}, Kind={kind})"
    validator = _schema_validator(kind, api_version, strict=True)
    if validator is not None:
        err = schema_error(validator, body)
        if err is not None:
            path = _schema_path(err.absolute_path)
            if err.validator == "additionalProperties":
                extra = re.findall(r"'([^']+)' was unexpected", err.message) or ["?"]
                return ApiError(
                    500, "InternalError", f"{where}: {path}.{extra[0]}: field not declared in schema"
                )
            return ApiError(500, "InternalError", f"{where}: {path}: {err.message}")
    for path, items, keys in _keyed_lists(body):
        seen: set[tuple[Any, ...]] = set()
        for item in items:
            k = tuple(item.get(x) for x in keys) if isinstance(item, dict) else (item,)
            if k in seen:
                label = ",".join(
                    f'{x}="{v}"' if isinstance(v, str) else f"{x}={v}" for x, v in zip(keys, k, strict=True)
                )
                return ApiError(500, "InternalError", f"{where}: {path}: duplicate entries for key [{label}]")
            seen.add(k)
    return None


def _keyed_lists(obj: Any, path: str = "") -> list[tuple[str, list[Any], tuple[str, ...]]]:
    """Lists the built-in schemas declare as maps (x-kubernetes-list-type: map) that our children use."""
    keys = {
        "containers": ("name",),
        "initContainers": ("name",),
        "env": ("name",),
        "volumes": ("name",),
        "volumeMounts": ("mountPath",),
        "ports": ("containerPort", "protocol"),
    }
    out: list[tuple[str, list[Any], tuple[str, ...]]] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            p = f"{path}.{k}"
            if isinstance(v, list) and k in keys and path.endswith(("spec", "]")):
                kk = keys[k]
                if k == "ports" and v and isinstance(v[0], dict) and "containerPort" not in v[0]:
                    kk = ("port", "protocol")  # a Service's ports
                norm = [
                    (
                        {**i, "protocol": i.get("protocol", "TCP")}
                        if k == "ports" and isinstance(i, dict)
                        else i
                    )
                    for i in v
                ]
                out.append((p, norm, kk))
            out += _keyed_lists(v, p)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _keyed_lists(v, f"{path}[{i}]")
    return out


# ---- server-side apply's merge (one field manager's set of fields) -------------------------------

#: Lists the built-in schemas merge by key (x-kubernetes-list-type: map) and their keys; every other
#: list is atomic (the applier's list replaces the live one).
LIST_MAP_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",),
    "initContainers": ("name",),
    "ephemeralContainers": ("name",),
    "env": ("name",),
    "volumes": ("name",),
    "volumeMounts": ("mountPath",),
    "imagePullSecrets": ("name",),
    "ports": ("containerPort", "protocol"),
}


#: Objects the built-in schemas mark atomic (a LabelSelector is `structType=atomic`; a Service's
#: selector and a pod's nodeSelector `mapType=atomic`): the applier's value replaces the live one.
ATOMIC_FIELDS = frozenset({"selector", "nodeSelector", "podSelector", "namespaceSelector", "labelSelector"})


def _list_keys(path: tuple[str, ...], items: list[Any]) -> tuple[str, ...] | None:
    field = path[-1] if path else ""
    if not items or not all(isinstance(i, dict) for i in items) or field not in LIST_MAP_KEYS:
        return None
    if field == "ports":
        if all("containerPort" in i for i in items):
            return LIST_MAP_KEYS["ports"]
        # A Service's ports are a map by port and protocol; a NetworkPolicy rule's ports are atomic.
        return ("port", "protocol") if path == ("spec", "ports") else None
    return LIST_MAP_KEYS[field]


def _item_key(keys: tuple[str, ...], item: Obj) -> tuple[Any, ...]:
    return tuple(item.get(k, "TCP" if k == "protocol" else None) for k in keys)


def apply_merge(live: Any, applied: Any, previous: Any, path: tuple[str, ...] = ()) -> Any:
    """What server-side apply stores when one manager applies `applied` over `live`, having applied
    `previous` before (its managed fields; None the first time): fields it applies take its values,
    fields it applied before and no longer does are removed, everyone else's fields stay. Maps merge
    by key, keyed lists (LIST_MAP_KEYS) by their items' keys (someone's extra env var stays beside
    ours, after them); atomic objects (ATOMIC_FIELDS), other lists and scalars are replaced."""
    if isinstance(applied, dict) and not (path and path[-1] in ATOMIC_FIELDS):
        out = copy.deepcopy(live) if isinstance(live, dict) else {}
        prev = previous if isinstance(previous, dict) else {}
        for k in prev:
            if k not in applied:
                out.pop(k, None)
        for k, v in applied.items():
            out[k] = apply_merge(out.get(k), v, prev.get(k), (*path, k))
        return out
    keys = _list_keys(path, applied) if isinstance(applied, list) else None
    if keys is not None:
        live_items = [i for i in live if isinstance(i, dict)] if isinstance(live, list) else []
        prev_items = [i for i in previous if isinstance(i, dict)] if isinstance(previous, list) else []
        live_by = {_item_key(keys, i): i for i in live_items}
        prev_by = {_item_key(keys, i): i for i in prev_items}
        mine = [_item_key(keys, i) for i in applied]
        out_list = [
            apply_merge(live_by.get(k), i, prev_by.get(k), (*path, "[]"))
            for k, i in zip(mine, applied, strict=True)
        ]
        return out_list + [
            copy.deepcopy(i)
            for i in live_items
            if _item_key(keys, i) not in mine and _item_key(keys, i) not in prev_by
        ]
    return copy.deepcopy(applied)
