"""pydantic's validation errors as (field path, message) pairs, the one way every component reports a
bad spec, request body, handoff message or connector config.

A path reads the way the user wrote the input: `a.b[0].c`, with `spell` applied to each name (the
operator spells the CRD's camelCase) and `root` in front (`spec`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pydantic import ValidationError


def field_path(loc: Sequence[int | str], *, root: str = "", spell: Callable[[str], str] = str) -> str:
    path = root
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{spell(part)}" if path else spell(part)
    return path


def problems(
    error: ValidationError, *, root: str = "", spell: Callable[[str], str] = str, show_input: bool = False
) -> list[tuple[str, str]]:
    """One (path, message) per error. `show_input` adds the value given to a field (not for secrets or
    big bodies); never for a missing field or an error about the whole input, whose input is all of it."""
    out = []
    for e in error.errors():
        # Our validators' messages are written for the user; pydantic's "Value error, " prefix is noise.
        message = str(e["ctx"]["error"]) if e["type"] == "value_error" and "ctx" in e else e["msg"]
        if show_input and e["loc"] and e["type"] != "missing":
            message += f" (got {e['input']!r})"
        out.append((field_path(e["loc"], root=root, spell=spell), message))
    return out


def summary(error: ValidationError, *, top: str = "", show_input: bool = False) -> str:
    """Every error on one line, `path: message; path: message`; `top` names the whole input, for an
    error that is about no one field."""
    return "; ".join(
        f"{path or top}: {message}" if path or top else message
        for path, message in problems(error, show_input=show_input)
    )
