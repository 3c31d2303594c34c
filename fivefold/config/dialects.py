"""Which dialect a dotted key speaks, and which canonical field it names.

| key                                         | dialect          |
|---------------------------------------------|------------------|
| `parallel.tensor_model_parallel_size`, `tp` | fivefold         |
| `actor.model.<field>`                       | rlinf            |
| `trainer.policy.megatron_config.<field>`    | skyrl (RL)       |
| `trainer.megatron.<field>`                  | skyrl (SFT)      |
| `trainer.placement.policy_num_nodes`, `..._num_gpus_per_node` | skyrl |
| `cfg.<any>.<field>`, `model.<parallel field>` | megatron-bridge |
| `allocation_mode`                           | areal            |

Megatron-Bridge and SkyRL keep every parallel knob on the model config (`cfg.model.x`); the field
name alone says which canonical section it belongs to, so `model.tensor_model_parallel_size` goes
to `parallel`.
"""
from __future__ import annotations

from fivefold.config.fields import ALIASES, SECTION_OF, SECTIONS, TYPES, did_you_mean
from fivefold.errors import UserError

FIVEFOLD, RLINF, SKYRL, BRIDGE, MEGATRON, AREAL = (
    "fivefold", "rlinf", "skyrl", "megatron-bridge", "megatron", "areal")
DIALECTS = (FIVEFOLD, RLINF, SKYRL, BRIDGE, MEGATRON, AREAL)

_PREFIXES = [
    ("trainer.policy.megatron_config.", SKYRL),
    ("trainer.megatron.", SKYRL),
    ("actor.model.", RLINF),
    ("cfg.", BRIDGE),
]
_RLINF_CLUSTER = {"cluster.num_gpus_per_node": "cluster.gpus_per_node"}
SKYRL_CLUSTER = {"trainer.placement.policy_num_nodes": "cluster.num_nodes",
                 "trainer.placement.policy_num_gpus_per_node": "cluster.gpus_per_node"}
"""SkyRL's placement of the policy (the model trained): its nodes and GPUs per node."""


def _by_name(name: str, key: str, dialect: str) -> str:
    if name in SECTION_OF:
        return f"{SECTION_OF[name]}.{name}"
    raise UserError(f"unknown {dialect} key {key!r}{did_you_mean(name, SECTION_OF)}")


def route(key: str) -> tuple[str, str]:
    """A dotted key of any dialect -> (dialect, dotted canonical field). UserError if unknown."""
    key = key.strip()
    for prefix, dialect in _PREFIXES:
        if key.startswith(prefix):
            rest = key[len(prefix):]
            name = rest.rsplit(".", 1)[-1] if dialect == BRIDGE else rest
            return dialect, _by_name(name.replace("-", "_"), key, dialect)
    if key in _RLINF_CLUSTER:
        return RLINF, _RLINF_CLUSTER[key]
    if key in SKYRL_CLUSTER:
        return SKYRL, SKYRL_CLUSTER[key]
    if key in ALIASES or key in TYPES:
        return FIVEFOLD, ALIASES.get(key, key)
    section, _, name = key.partition(".")
    if section == "grpo":
        raise UserError(f"{key}: the grpo: section is read by `fivefold rl` (GRPO, fivefold.rl.grpo), not by "
                        "train / validate / estimate: run `python -m fivefold rl FILE` (examples/grpo.yaml)")
    if key == "model.path":  # SkyRL's (its SFT script's model.path=Qwen/...): the model, never the data
        raise UserError("model.path (SkyRL's Hugging Face model to train) is not read as a model here: give "
                        "checkpoint.load_hf=DIR (--load-hf), a local Hugging Face folder with config.json and "
                        "safetensors; nothing is downloaded")
    if section in ("model", "parallel", "training", "data", "checkpoint", "logging", "cluster") and name:
        choices = [k for k in TYPES if k.startswith(section + ".")]
        if name in SECTION_OF:  # the right field in another section: say where it lives
            raise UserError(f"unknown config key {key!r} (did you mean {SECTION_OF[name]}.{name}?)")
        if name in ALIASES:  # a short name under a section: the field it stands for
            raise UserError(f"unknown config key {key!r} (did you mean {ALIASES[name]}, or {name} alone?)")
        raise UserError(f"unknown config key {key!r}{did_you_mean(key, choices)}")
    if not section or "." not in key:
        if key in SECTION_OF:
            return FIVEFOLD, f"{SECTION_OF[key]}.{key}"
        if key in SECTIONS:
            field = next(k for k in TYPES if k.startswith(key + "."))
            raise UserError(f"config key {key!r} is a section, not a value: give its fields, as words "
                            f"({field}=...) or in YAML as a mapping under {key}:")
    known = list(TYPES) + list(ALIASES) + [p + "<field>" for p, _ in _PREFIXES]
    raise UserError(f"unknown config key {key!r}{did_you_mean(key, known)}")


def combine(dialects: list[str]) -> str:
    """The dialect of a config built from several sources (a file, then words).

    fivefold's own keys mix with any dialect; two other dialects would disagree on rules (SP with
    TP=1 is an error in RLinf's, a warning in Megatron's, automatic in SkyRL's), so they do not mix.
    """
    others = sorted(set(d for d in dialects if d != FIVEFOLD))
    if len(others) > 1:
        raise UserError(f"this config mixes dialects {', '.join(others)}; use one of them "
                        "(fivefold's own keys and aliases mix with any)")
    return others[0] if others else FIVEFOLD
