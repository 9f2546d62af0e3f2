"""What went wrong in a reconcile, in the words the status and the Events use.

A `Failure` is one child (or the reconcile itself) that could not be made what the spec says; its
reason is one of ChildNotOwned, Forbidden, ApplyRejected or ReconcileError, most pressing first
(SEVERITY). `failure` turns an API server's answer into one: a 403 becomes Forbidden with the verb
and resource the operator's role lacks and where to fix it (the chart's RBAC), anything else keeps
the API server's own message. `reconciled` and `children_owned` are the two conditions the failures
decide. Pure: nothing here calls the API server.
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

from tilert_operator import constants, kubeapi, status
from tilert_operator.kubeapi import ApiError

#: Seconds until a reconcile that could not apply a child runs again (a spec change runs it sooner).
FAILED_RETRY_S = 10.0
RECONCILED = "Reconciled"
CHILDREN_OWNED = "ChildrenOwned"
CHILD_NOT_OWNED = "ChildNotOwned"
FORBIDDEN = "Forbidden"
APPLY_REJECTED = "ApplyRejected"
RECONCILE_ERROR = "ReconcileError"
#: Ready's reason while the current generation could not be applied (Reconciled=False says why).
NOT_APPLIED = "NotApplied"
#: Reasons of a Failure, most pressing first: Reconciled takes the first that any failure has (each
#: failure's own Event keeps its own reason).
SEVERITY = (CHILD_NOT_OWNED, FORBIDDEN, APPLY_REJECTED, RECONCILE_ERROR)
#: What to do about a 403: the role comes from the chart, and an older chart lacks newer rules.
RBAC_FIX = "fix the chart's RBAC or install the chart's current version"


class Failure(NamedTuple):
    """A child (or the reconcile) that could not be made what the spec says."""

    key: str  # Kind/name, or "reconcile"
    message: str
    reason: str = APPLY_REJECTED


def api_message(error: ApiError) -> str:
    """The API server's own message in a failed call (its Status's `message`, after the HTTP status),
    else the error's text."""
    for attr in ("message", "body", "text"):  # a richer ApiError keeps the whole answer
        value = getattr(error, attr, None)
        if isinstance(value, dict) and isinstance(value.get("message"), str):
            code = getattr(error, "status", None)
            return (f"HTTP {code}: " if code else "") + str(value["message"])
        if isinstance(value, str):
            found = _message_in(value)
            if found:
                return found
    return _message_in(str(error)) or str(error)


def _message_in(text: str) -> str | None:
    m = re.search(r'"message":\s*"((?:[^"\\]|\\.)*)("?)', text)
    if m is None:
        return None
    raw, closed = m.groups()
    try:
        message = str(json.loads(f'"{raw}"'))
    except ValueError:
        message = raw
    code = re.search(r"HTTP (\d{3})", text)
    prefix = f"HTTP {code.group(1)}: " if code else ""
    return prefix + message + ("" if closed else "...")


def forbidden(error: ApiError, *, verb: str | None = None, kind: str | None = None) -> str | None:
    """For a 403, what the operator's role lacks and what to do; None for any other error.

    A refusal by the authorization filter names the verb and the resource; OwnerReferencesPermission-
    Enforcement's names what it checks in words; a create refused inside a server-side apply names
    neither (the RBAC authorizer gives no reason), so `verb` and `kind` (the call that failed: "create"
    for an apply that creates) stand in for what the answer leaves out."""
    if error.status != 403:
        return None
    text = api_message(error)
    details = (error.body or {}).get("details") or {}
    group, resource = kubeapi.group_resource(kind) if kind is not None and kind in kubeapi.KINDS else ("", "")
    if details.get("kind"):
        group, resource = str(details.get("group") or ""), str(details["kind"])
    said = re.search(r'cannot (\S+) resource "([^"]+)" in API group "([^"]*)"', text)
    if said:
        verb, resource, group = said.groups()
    elif "can't set finalizers on" in text:  # blockOwnerDeletion: the owner's finalizers subresource
        verb, resource, group = "update", f"{constants.PLURAL}/finalizers", constants.GROUP
    elif "on a resource you can't delete" in text:  # changing an object's ownerReferences
        verb = "delete"
    where = f' in API group "{group}"' if group else ""
    lacks = (
        f"{verb} on {resource or 'a resource'}{where}"
        if verb
        else f"a permission on {resource or 'a resource'}{where}"
    )
    return f"forbidden: the operator's role lacks {lacks} ({RBAC_FIX}); the API server said: {text}"


def failure(
    key: str,
    error: ApiError,
    *,
    verb: str | None = None,
    kind: str | None = None,
    otherwise: str = APPLY_REJECTED,
    prefix: str = "",
) -> Failure:
    """A failed call as a Failure: Forbidden when the role refused it, else `otherwise`."""
    lacking = forbidden(error, verb=verb, kind=kind)
    if lacking is not None:
        return Failure(key, prefix + lacking, FORBIDDEN)
    return Failure(key, prefix + api_message(error), otherwise)


def reconciled(failed: list[Failure]) -> status.Condition:
    """Reconciled: whether every child the spec wants is what the API server holds. Only a refusal
    of what the spec rendered (ApplyRejected) sends the reader to the spec."""
    if not failed:
        return {
            "type": RECONCILED,
            "status": "True",
            "reason": "Applied",
            "message": "every child matches the spec",
        }
    reason = next(r for r in SEVERITY if any(f.reason == r for f in failed))
    listed = "; ".join(f"{f.key}: {f.message}" for f in failed)
    spec_fix = (
        "; fix the spec field that renders it" if any(f.reason == APPLY_REJECTED for f in failed) else ""
    )
    return {
        "type": RECONCILED,
        "status": "False",
        "reason": reason,
        "message": f"{listed} (retried every {FAILED_RETRY_S:.0f}s and on every spec change{spec_fix}; see the Events)",
    }


def children_owned(failed: list[Failure]) -> status.Condition:
    """ChildrenOwned: no object the stack needs is someone else's under the child's name."""
    foreign = [f for f in failed if f.reason == CHILD_NOT_OWNED]
    if not foreign:
        return {
            "type": CHILDREN_OWNED,
            "status": "True",
            "reason": "Owned",
            "message": "every child is this PDCluster's",
        }
    return {
        "type": CHILDREN_OWNED,
        "status": "False",
        "reason": CHILD_NOT_OWNED,
        "message": "; ".join(f.message for f in foreign),
    }
