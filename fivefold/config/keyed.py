"""How a dotted key of a tool's own config surface is taken: the four outcomes every dialect shares.

Megatron-Bridge, RLinf and SkyRL each have a pinned key list (generated from their sources) and one
classification table (fivefold.config.bridge, .rlinf, .skyrl). A key is then

  MAPPED     set canonical field(s), the value translated where the tool's value means something else;
  NOTE       accepted without effect here (speed, logging, housekeeping, or a value that is the
             tool's default and builds nothing): `validate` lists it with the reason;
  NOT_BUILT  changes the math here and is not built: refused, all such keys in one message;
  UNKNOWN    not in the tool's surface: refused with the closest keys.

`Refusals` gathers the last two over a whole config, so one message names every key to change.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fivefold.errors import NotImplementedYet, UserError

MAPPED, NOTE, NOT_BUILT, UNKNOWN = "mapped", "no effect", "not built", "unknown"


@dataclass
class Taken:
    how: str
    pairs: list[tuple[str, object]] = field(default_factory=list)
    """(dotted canonical field, value) to set, for MAPPED."""
    why: str = ""
    """The reason (NOTE), what would work (NOT_BUILT), or the did-you-mean (UNKNOWN)."""


@dataclass
class Refusals:
    """Unknown and not-built keys of one config, refused together at the end of loading."""
    unknown: list[str] = field(default_factory=list)
    not_built: list[str] = field(default_factory=list)

    def add(self, key: str, taken: Taken) -> None:
        if taken.how == UNKNOWN:
            self.unknown.append(f"{key}{taken.why}")
        elif taken.how == NOT_BUILT:
            self.not_built.append(f"{key}{taken.why}")

    def raise_all(self) -> None:
        s = "s" if len(self.not_built) > 1 else ""
        built = f"key{s} {', '.join(self.not_built)} (they change what is trained)"
        if self.unknown:
            s = "s" if len(self.unknown) > 1 else ""
            raise UserError(f"unknown config key{s} " + "; ".join(self.unknown)
                            + (f" | {built}: not implemented yet" if self.not_built else ""))
        if self.not_built:
            raise NotImplementedYet(built)


def plain(value: object) -> object:
    """A command-line word as the YAML scalar it would be (True, 3, 0.1, None), for comparisons."""
    if not isinstance(value, str):
        return value
    word = value.strip().strip("'\"")
    low = word.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null", "~", ""):
        return None
    for number in (int, float):
        try:
            return number(word)
        except ValueError:
            pass
    return word


def truthy(value: object) -> bool:
    v = plain(value)
    if not isinstance(v, (bool, int, type(None))):
        raise UserError(f"{value!r} is not a boolean (true or false)")
    return bool(v)
