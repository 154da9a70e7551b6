"""Checks shared by every YAML/JSON input qtk parses (recipes, task files): unknown keys with a suggestion, typed values.
Every error names the key and the fix."""

from __future__ import annotations

import difflib
from typing import Mapping

from qtk.errors import UsageError


def suggest_key(key: str, valid) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1)
    return f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(sorted(valid))}"


def check_keys(d: Mapping, valid, where: str) -> None:
    """Refuse a non-mapping or a key outside `valid`, suggesting the closest valid key (shared by task files)."""
    if not isinstance(d, Mapping):
        raise UsageError(f"{where}: expected a mapping, got {type(d).__name__}", "write it as 'key: value' lines")
    for k in d:
        if not isinstance(k, str) or k not in valid:
            raise UsageError(f"{where}: unknown key {k!r}", suggest_key(str(k), valid))


def typed(d: Mapping, key: str, kind, where: str, default=None):
    v = d.get(key)
    if v is None:  # absent or an explicit null ('key:' with no value): the default, never None in its place
        return default
    ok = isinstance(v, kind) and not (kind is int and isinstance(v, bool))
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v, ok = float(v), True
    if not ok:
        name = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise UsageError(f"{where}.{key}: expected {name}, got {v!r}", f"set {key} to a {name}")
    return v
