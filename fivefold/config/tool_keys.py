"""One dotted key of any dialect, taken: the tool tables first (SkyRL, RLinf, Megatron-Bridge), then
fivefold's own routing (fivefold.config.dialects.route).

    dialect, notes = take(config, "cfg.model.num_moe_experts", 8, explicit, refusals)

A key a tool table classifies as not built or unknown is added to `refusals` (reported with every
other one at the end of loading); one without effect comes back as a note for `validate`.
"""
from __future__ import annotations

from fivefold.config import bridge, rl_keys
from fivefold.config.dialects import BRIDGE, RLINF, SKYRL, route
from fivefold.config.fields import TYPES, set_value
from fivefold.config.keyed import MAPPED, NOTE, Refusals, Taken
from fivefold.errors import UserError

_OBJECT_KEYS = ("_target_", "_partial_", "_args_")
"""Hydra / OmegaConf object-spec keys inside a Bridge YAML: a class path, not a setting."""


def _bridge(key: str, value: object) -> Taken | None:
    """How Megatron-Bridge takes `key`, or None if the key is not Bridge's."""
    bare = key.removeprefix("cfg.")
    if bare == "mixed_precision" and (key != bare or isinstance(value, str)):
        return bridge.classify_recipe(value)
    if bare.startswith("env_vars.") and key != bare:
        return Taken(NOTE, why="an environment variable for Bridge's processes")
    name = bridge.bridge_key(key)
    if name is None:
        return None
    section, _, rest = name.partition(".")
    if rest in _OBJECT_KEYS:
        return Taken(NOTE, why="the class Bridge instantiates for this section")
    field, _, sub = rest.partition(".")
    if sub and f"{section}.{field}" in bridge.SURFACE:  # an object spec under a field (activation_func._target_)
        return bridge.classify(f"{section}.{field}", {sub: value})
    return bridge.classify(name, value)


_RL_PREFIXES = [("trainer.policy.megatron_config.", SKYRL, rl_keys.classify_skyrl),
                ("trainer.megatron.", SKYRL, rl_keys.classify_skyrl),
                *((f"actor.{s}.", RLINF, rl_keys.classify_rlinf) for s in ("model", "optim", "lr_sched", "megatron"))]


def _tool(key: str, value: object) -> tuple[str, Taken] | None:
    """(dialect, how the tool's table takes `key`), or None for a key no tool table holds."""
    for prefix, dialect, classify in _RL_PREFIXES:
        if key.startswith(prefix):
            rest = key[len(prefix):] if dialect == SKYRL else key[len("actor."):]
            return dialect, classify(rest, value)
    taken = _bridge(key, value)
    return (BRIDGE, taken) if taken else None


def take(config, key: str, value: object, explicit: set[str], refusals: Refusals) -> tuple[str, list[str]]:
    """Set what `key=value` means on `config`; return (dialect, notes on keys taken without effect).

    The dialect is None for a key that means the same in fivefold and Megatron-Bridge (`model.num_layers`,
    `checkpoint.save`): it counts for either, so a Bridge YAML with a `model:` section is all Bridge."""
    if isinstance(value, str) and "${" in value:
        raise UserError(f"{key}={value}: an OmegaConf interpolation; fivefold reads values, not references "
                        "(write the value itself)")
    tool = _tool(key, value)
    if tool is None:
        dialect, dotted = route(key)
        set_value(config, dotted, value, explicit)
        return (None if key in bridge.SURFACE else dialect), []
    dialect, taken = tool
    if taken.how == NOTE:
        return dialect, [f"{key}: {taken.why}"]
    if taken.how != MAPPED:
        refusals.add(key, taken)
        return dialect, []
    notes = []
    for dotted, v in taken.pairs:
        if v is None and "None" not in TYPES[dotted]:  # Bridge's "unset": ours keeps its default
            notes.append(f"{key}: None, so {dotted} keeps its default")
            continue
        set_value(config, dotted, v, explicit)
    return dialect, notes
