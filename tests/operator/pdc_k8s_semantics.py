"""Kubernetes API semantics the test server needs, as plain functions: merge and JSON patches,
label and field selectors, the JSONPath subset of printer columns, and the API's error type."""

from __future__ import annotations

import copy
import re
from typing import Any

Obj = dict[str, Any]


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


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
