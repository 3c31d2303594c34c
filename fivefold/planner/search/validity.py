"""Is a candidate config valid? The foundation's rules decide (one set of rules for the whole tree)."""
from __future__ import annotations

from fivefold.config.schema import Config

from fivefold.config.rules import KNOB_FIELDS, adjust, errors, exchange_errors, sizes_of


def config_errors(config: Config, dialect: str = "fivefold") -> list[str]:
    """The broken rules of `config` (empty when valid), after the dialect's own adjustments, which
    are applied to `config` (e.g. SP turned on for EP with TP). Fast: no fix search."""
    return checked(config, dialect)[0]


def checked(config: Config, dialect: str = "fivefold") -> tuple[list[str], dict]:
    """`config_errors`, and the adjusted sizes the rules read (`rules.sizes_of`), for `twin_errors`."""
    s = sizes_of(config)
    adjust(s, dialect)
    return _applied(config, s, errors(s)), s


def twin_errors(config: Config, valid: dict) -> list[str]:
    """`config_errors` of `config`, equal but for its CP exchange (parallel.cp_comm_type) to a valid
    config of the same dialect whose adjusted sizes are `valid` (`checked`): only the rules that read
    the exchange are checked (`rules.exchange_errors`; the search meets a layout's p2p and a2a twins)."""
    s = dict(valid, cp_comm=config.parallel.cp_comm_type)
    return _applied(config, s, exchange_errors(s))


def _applied(config: Config, s: dict, broken: list) -> list[str]:
    """`broken` as messages; where none, the adjusted knobs written to `config`."""
    if not broken:
        for knob in ("vpp", "schedule", "sp"):
            section, name = KNOB_FIELDS[knob].split(".")
            setattr(getattr(config, section), name, s[knob])
    return [f"{r.field}={r.value!r}: {r.rule}" for r in broken]
