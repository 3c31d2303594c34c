"""Every canonical field by its dotted name, typed value parsing, and one setter all dialects share.

A dialect only decides *which* canonical field a key or flag names; this module turns the raw value
(a YAML scalar or a command-line word) into the field's type and records that it was set, so that
later rules can tell an explicit value from a default.
"""
from __future__ import annotations

import difflib
from dataclasses import fields

from fivefold.config.schema import SECTIONS, Config
from fivefold.errors import UserError

# Short aliases of our own dotted overrides (`tp=2`).
ALIASES = {
    "tp": "parallel.tensor_model_parallel_size",
    "pp": "parallel.pipeline_model_parallel_size",
    "vpp": "parallel.virtual_pipeline_model_parallel_size",
    "cp": "parallel.context_parallel_size",
    "ep": "parallel.expert_model_parallel_size",
    "etp": "parallel.expert_tensor_parallel_size",
    "sp": "parallel.sequence_parallel",
}

TYPES: dict[str, str] = {
    f"{section}.{f.name}": str(f.type) for section, cls in SECTIONS.items() for f in fields(cls)
}
"""Dotted canonical name -> its annotation as written in its section (fivefold/config/sections/, e.g. 'int | None')."""

SECTION_OF: dict[str, str] = {}
"""Bare field name -> its section, for the names that occur in exactly one section."""
for _dotted in TYPES:
    _section, _name = _dotted.split(".", 1)
    SECTION_OF[_name] = _section if _name not in SECTION_OF else "?"
SECTION_OF = {k: v for k, v in SECTION_OF.items() if v != "?"}

_NONE_WORDS = {"none", "null", "~", ""}
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


KIND_WORDS = {"int": "a whole number", "float": "a number", "bool": "true or false", "str": "text",
              "list[str]": "a list of words", "list[int]": "a list of whole numbers"}
"""How a refused value's expected kind is said (`parse`'s schema types)."""


def did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def resolve(key: str) -> str:
    """A dotted canonical name or alias -> the dotted canonical name; UserError with a suggestion."""
    key = key.strip()
    if key in ALIASES:
        return ALIASES[key]
    key = key.replace("-", "_")
    if key in ALIASES:
        return ALIASES[key]
    if key in TYPES:
        return key
    if key in SECTION_OF:
        return f"{SECTION_OF[key]}.{key}"
    raise UserError(f"unknown config key {key!r}{did_you_mean(key, list(TYPES) + list(ALIASES))}")


def coerce(dotted: str, raw: object):
    """`raw` (a YAML value or a command-line word) as the type of field `dotted`."""
    ann = TYPES[dotted]
    optional = "None" in ann
    base = ann.replace("| None", "").strip()
    if isinstance(raw, str) and raw.strip().lower() in _NONE_WORDS and optional:
        return None
    if raw is None:
        if optional:
            return None
        raise UserError(f"{dotted} cannot be empty (it is a {base})")
    try:
        if base == "bool":
            if isinstance(raw, bool):
                return raw
            word = str(raw).strip().lower()
            if word in _TRUE:
                return True
            if word in _FALSE:
                return False
            raise ValueError(raw)
        if base == "int":
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError(raw)
            return int(str(raw).strip()) if isinstance(raw, str) else int(raw)
        if base == "float":
            return float(raw)
        if base == "str":  # a list (a YAML list, a command-line flag's values) as its words
            return " ".join(str(v) for v in raw) if isinstance(raw, (list, tuple)) else str(raw)
        if base == "list[str]":
            if isinstance(raw, str):
                raw = raw.strip().strip("[]()").replace(",", " ").split()
            return [str(v) for v in (raw if isinstance(raw, (list, tuple)) else [raw])]
        if base == "list[int]":
            if isinstance(raw, str):
                raw = [w for w in raw.strip().strip("[]()").replace(",", " ").split()]
            if not isinstance(raw, (list, tuple)):
                raw = [raw]
            return [int(v) for v in raw]
    except (TypeError, ValueError):
        pass
    else:
        raise AssertionError(f"schema type {ann!r} of {dotted} has no parser")
    raise UserError(f"{dotted}={raw!r} is not {KIND_WORDS.get(base, 'a ' + base)}")


def set_value(config: Config, dotted: str, raw: object, explicit: set[str]) -> None:
    """Set canonical field `dotted` of `config` from `raw` and record it in `explicit`."""
    section, name = dotted.split(".", 1)
    setattr(getattr(config, section), name, coerce(dotted, raw))
    explicit.add(dotted)
