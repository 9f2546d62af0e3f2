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


def problems(error: ValidationError, *, root: str = "", spell: Callable[[str], str] = str,
             show_input: bool = False) -> list[tuple[str, str]]:
    """One (path, message) per error; `show_input` adds what was given (not for secrets or big bodies)."""
    out = []
    for e in error.errors():
        message = f"{e['msg']} (got {e.get('input')!r})" if show_input else e["msg"]
        out.append((field_path(e["loc"], root=root, spell=spell), message))
    return out


def summary(error: ValidationError, *, top: str = "", show_input: bool = False) -> str:
    """Every error on one line, `path: message; path: message`; `top` names the whole input, for an
    error that is about no one field."""
    return "; ".join(f"{path or top}: {message}" if path or top else message
                     for path, message in problems(error, show_input=show_input))
