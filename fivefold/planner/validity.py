"""Is a candidate config valid? The foundation's rules decide (one set of rules for the whole tree)."""
from __future__ import annotations

from fivefold.config.schema import Config

from fivefold.config.rules import KNOB_FIELDS, adjust, errors, sizes_of


def config_errors(config: Config, dialect: str = "fivefold") -> list[str]:
    """The broken rules of `config` (empty when valid), after the dialect's own adjustments, which
    are applied to `config` (e.g. SP turned on for EP with TP). Fast: no fix search."""
    s = sizes_of(config)
    adjust(s, dialect)
    broken = errors(s)
    if not broken:
        for knob in ("vpp", "schedule", "sp"):
            section, name = KNOB_FIELDS[knob].split(".")
            setattr(getattr(config, section), name, s[knob])
    return [f"{r.field}={r.value!r}: {r.rule}" for r in broken]
