"""The metric names a PromQL expression reads. promtool checks the syntax; this only has to find the
names: strings, label matchers, range and subquery brackets, grouping clauses, durations and numbers
are cut out first, and what is left that is neither a function call nor a keyword is a metric name."""

from __future__ import annotations

import re

_STRINGS = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_DURATIONS = re.compile(r"\b\d+(?:ms|s|m|h|d|w|y)\b")
_NUMBERS = re.compile(r"(?<![\w:])\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset"}
    | {"inf", "nan", "Inf", "NaN"}
)


def metric_names(expr: str) -> set[str]:
    text = _STRINGS.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _BRACKETS.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _DURATIONS.sub(" ", text)
    text = _NUMBERS.sub(" ", text)
    names: set[str] = set()
    for m in _IDENT.finditer(text):
        if m.group() in _KEYWORDS or re.match(r"\s*\(", text[m.end() :]):
            continue
        names.add(m.group())
    return names
