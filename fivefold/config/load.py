"""Load a config from a file and command-line words, in any dialect, into the canonical Config.

    loaded = load_config("examples/rlinf.yaml", ["tp=2", "--seq-length", "4096"], nodes=2)
    problems = validate(loaded.config, loaded.dialect)

The file is YAML (our sections, or RLinf's `actor.model` / `cluster`), or a `.txt` file of words
(one Megatron-LM command line, SkyRL / Megatron-Bridge overrides, an AReaL `allocation_mode=...`;
`#` starts a comment, a trailing backslash continues a line). Words are `key=value` overrides or
`--flags`; a leading `torchrun --nproc_per_node=G --nnodes=N script.py` sets the cluster and is
skipped. Later sources win: file, then words, then the keyword arguments.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from fivefold.config.dialects import AREAL, MEGATRON, combine, route
from fivefold.config.fields import set_value
from fivefold.config.megatron import is_flag, parse_flags
from fivefold.config.schema import Config
from fivefold.config.validate import Problem
from fivefold.errors import UserError

SPECIAL_KEYS = ("models", "allocation_mode")


@dataclass
class Loaded:
    config: Config
    dialect: str
    warnings: list[Problem] = field(default_factory=list)
    explicit: set[str] = field(default_factory=set)
    """Dotted canonical fields some source set (the rest are defaults)."""
    allocation: object | None = None
    """fivefold.allocation.Allocation for an AReaL allocation mode or a `models:` list, else None."""


def load_config(path: str | None, words: list[str] = (), *, world_size: int | None = None,
                nodes: int | None = None, gpus_per_node: int | None = None) -> Loaded:
    config, explicit, dialects, special = Config(), set(), [], {}
    words = list(words)
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"config file {path} not found")
        if p.suffix in (".txt", ".sh", ".args"):
            words = read_words(p.read_text()) + words
        else:
            _apply_yaml(config, p, explicit, dialects, special)
    _apply_words(config, words, explicit, dialects, special)
    for dotted, value in (("cluster.world_size", world_size), ("cluster.num_nodes", nodes),
                          ("cluster.gpus_per_node", gpus_per_node)):
        if value is not None:
            set_value(config, dotted, value, explicit)
    if nodes is not None and world_size is None:
        config.cluster.world_size = None
    if "allocation_mode" in special:
        dialects.append(AREAL)
    dialect = combine(dialects)
    loaded = Loaded(config, dialect, explicit=explicit)
    if special:
        from fivefold.allocation import attach
        attach(loaded, special)
    return loaded


def read_words(text: str) -> list[str]:
    """Words of a shell-like text: comments dropped, backslash-newline joins lines."""
    lines = [line.split("#", 1)[0] if not line.lstrip().startswith("#!") else "" for line in
             text.replace("\\\n", " ").splitlines()]
    return shlex.split(" ".join(lines))


def _flatten(data: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out += _flatten(v, key + ".")
        else:
            out.append((key, v))
    return out


def _apply_yaml(config: Config, p: Path, explicit: set, dialects: list, special: dict) -> None:
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise UserError(f"{p}: not valid YAML: {e}") from None
    if data is None:
        return
    if not isinstance(data, dict):
        raise UserError(f"{p}: expected a mapping of sections at the top level")
    for key in SPECIAL_KEYS:
        if key in data:
            special[key] = data.pop(key)
    for key, value in _flatten(data):
        dialect, dotted = route(key)
        dialects.append(dialect)
        set_value(config, dotted, value, explicit)


def _apply_words(config: Config, words: list[str], explicit: set, dialects: list, special: dict) -> None:
    words = _strip_launcher(config, words, explicit)
    i = 0
    while i < len(words):
        if is_flag(words[i]):
            j = i + 1
            while j < len(words) and (is_flag(words[j]) or "=" not in words[j]):
                j += 1
            pairs, megatron = parse_flags(words[i:j])
            if megatron:
                dialects.append(MEGATRON)
            for _, dotted, value in pairs:
                set_value(config, dotted, value, explicit)
            i = j
            continue
        key, eq, value = words[i].partition("=")
        if not eq:
            raise UserError(f"{words[i]!r} is neither key=value nor a --flag")
        key = key.strip()
        if key.lstrip("+") in SPECIAL_KEYS:
            special[key.lstrip("+")] = value
        else:
            dialect, dotted = route(key.lstrip("+"))  # Hydra's `+key=value` adds a key
            dialects.append(dialect)
            set_value(config, dotted, value, explicit)
        i += 1


def _strip_launcher(config: Config, words: list[str], explicit: set) -> list[str]:
    """Drop `torchrun [launcher flags] script.py` (or `-m module subcommand`), keeping --nproc_per_node
    and --nnodes."""
    if not words or Path(words[0]).name not in ("torchrun", "torch.distributed.run"):
        return words
    i = 1
    launcher = {"--nproc_per_node": "cluster.gpus_per_node", "--nproc-per-node": "cluster.gpus_per_node",
                "--nnodes": "cluster.num_nodes"}
    while i < len(words) and words[i].startswith("-"):
        name, eq, value = words[i].partition("=")
        if not eq and i + 1 < len(words) and not words[i + 1].startswith("-") \
                and not words[i + 1].endswith(".py"):
            value, i = words[i + 1], i + 1
        if name in launcher:
            set_value(config, launcher[name], value, explicit)
        i += 1
        if name == "-m":  # `-m fivefold train`: the module's own subcommand words are not config
            while i < len(words) and not words[i].startswith("-") and "=" not in words[i]:
                i += 1
            return words[i:]
    if i < len(words) and words[i].endswith(".py"):
        i += 1
    return words[i:]
