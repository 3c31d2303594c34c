"""Load a config from a file and command-line words, in any dialect, into the canonical Config.

    loaded = load_config("examples/rlinf.yaml", ["tp=2", "--seq-length", "4096"], nodes=2)
    problems = validate(loaded.config, loaded.dialect)

The file is YAML (our sections, or RLinf's `actor.model` / `cluster`), or a `.txt` file of words
(one Megatron-LM command line, SkyRL / Megatron-Bridge overrides, an AReaL `allocation_mode=...`;
`#` starts a comment, a trailing backslash continues a line). Words are `key=value` overrides or
`--flags`; a leading `torchrun --nproc_per_node=G --nnodes=N script.py` sets the cluster (its other
options are noted; fivefold.config.torchrun). Keys of Megatron-Bridge, RLinf and SkyRL go through their
tools' tables (fivefold.config.tool_keys): unknown and not-built keys are refused together, after all
sources are read. Later sources win: file, then words, then the keyword arguments.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import yaml

from fivefold.config.dialects import AREAL, BRIDGE, MEGATRON, combine
from fivefold.config import bridge
from fivefold.config.fields import set_value
from fivefold.config.hf import config_from_hf, unread_note
from fivefold.config.keyed import Refusals
from fivefold.config.megatron import is_flag, parse_flags
from fivefold.config.megatron_defaults import WHY, apply_megatron_defaults
from fivefold.config.schema import SECTIONS, Config
from fivefold.config.tool_keys import take
from fivefold.config.torchrun import strip_launcher
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
    """fivefold.config.allocation.Allocation for an AReaL allocation mode or a `models:` list, else None."""


def load_config(path: str | None, words: list[str] = (), *, world_size: int | None = None,
                nodes: int | None = None, gpus_per_node: int | None = None) -> Loaded:
    config, explicit, dialects, special = Config(), set(), [], {}
    switches: set[str] = set()  # table flags that set no field
    refusals, key_notes = Refusals(), []  # tool keys refused (all at once) / taken without effect
    words = _one_half_precision(list(words), "the command line")
    notes: list[Problem] = []
    files = None
    if path is not None:
        p = Path(path)
        if not is_file(path):
            raise UserError(f"config file {path[:200]} " + ("is a folder: give a file in it" if p.is_dir() else
                                                            "not found"))
        text = _read_text(p)
        if p.suffix in (".txt", ".sh", ".args"):
            try:
                file_words = _one_half_precision(read_words(text), str(p))
            except ValueError as e:  # shlex: an unclosed quote
                raise UserError(f"{p}: {e} (a .txt config is one shell-like command line)") from None
            _apply_words(config, file_words, explicit, dialects, special, notes, switches, refusals, key_notes)
        else:
            _apply_yaml(config, p, text, explicit, dialects, special, refusals, key_notes)
        files = list(dialects)  # the file's dialect decides which tool's defaults apply; the words override it
    _apply_words(config, words, explicit, dialects, special, notes, switches, refusals, key_notes)
    refusals.raise_all()
    if key_notes:
        notes.append(Problem("tool keys", len(key_notes), "accepted without effect here: " + "; ".join(key_notes),
                             "nothing to do", "warning"))
    for dotted, value in (("cluster.world_size", world_size), ("cluster.num_nodes", nodes),
                          ("cluster.gpus_per_node", gpus_per_node)):
        if value is not None:
            set_value(config, dotted, value, explicit)
    _check_cluster(config, explicit)
    if config.training.fp8_format is not None and config.training.precision != "fp8":
        # Megatron's --fp8-format beside --bf16 (whatever their order): fp8 GEMMs on 16-bit parameters
        set_value(config, "training.precision", "fp8", explicit)
    # A tool's file (or, without a file, the tool's keys among the words) means that tool's defaults for what it
    # leaves out; our own keys mixed in change none of them, and a tool's flags on our YAML add none.
    tool = combine(dialects if files is None else files) if dialects else None
    if tool == MEGATRON:  # a Megatron command line: what it leaves out is Megatron's default
        changed = apply_megatron_defaults(config, explicit, switches)
        defaults, overruled = [d for d in changed if d not in explicit], [d for d in changed if d in explicit]
        if defaults:
            notes.append(Problem("megatron defaults", len(defaults), "not given, so Megatron-LM's: " + ", ".join(
                _taken(config, d) for d in defaults),
                "set the flag to choose otherwise", "warning"))
        if overruled:  # a flag given that Megatron-LM's own rules set aside (--num-query-groups without GQA)
            notes.append(Problem("megatron rules", len(overruled), "given, but set as Megatron-LM sets it: " + ", ".join(
                _taken(config, d) for d in overruled), "see the reason given", "warning"))
    if tool == BRIDGE:  # a Megatron-Bridge config: what it leaves out is Bridge's default
        changed = bridge.apply_defaults(config, explicit)
        if changed:
            notes.append(Problem("megatron-bridge defaults", len(changed), "not given, so Megatron-Bridge's: "
                                 + ", ".join(_taken(config, d) for d in changed), "set the field to choose otherwise",
                                 "warning"))
    if config.training.step_batch_size_schedule and "training.global_batch_size" in explicit:
        raise UserError("training.step_batch_size_schedule and training.global_batch_size are both given (Megatron-LM "
                        "refuses --step-batch-size-schedule with --global-batch-size): drop --global-batch-size, the "
                        "schedule's last entry is the batch the run grows to")
    for a, b, rule in (("train_iters", "train_samples", "runs for iterations or for samples"),
                       ("lr_warmup_fraction", "lr_warmup_iters", "warms up for a share of the decay or for iterations"),
                       ("lr_warmup_fraction", "lr_warmup_samples", "warms up for a share of the decay or for samples")):
        given = [f"training.{x}" in explicit and getattr(config.training, x) not in (None, 0) for x in (a, b)]
        if all(given):  # Megatron-LM asserts one of each pair
            raise UserError(f"training.{a} and training.{b} are both given: a run {rule}, not both (Megatron-LM "
                            f"asserts the same); drop one")
    if "--no-position-embedding" in switches and config.model.position_embedding_type != "rope":
        raise UserError("--no-position-embedding is deprecated in Megatron-LM and only accepted (and ignored) with "
                        "rope positions; for no position embedding give --position-embedding-type none")
    warnings = _model_from_hf(config, explicit) if config.checkpoint.load_hf else []
    if "allocation_mode" in special:
        dialects.append(AREAL)
    dialect = combine(dialects)
    loaded = Loaded(config, dialect, explicit=explicit)
    loaded.warnings += notes + warnings
    if special:
        from fivefold.config.allocation import attach
        attach(loaded, special)
    return loaded


def _taken(config: Config, dotted: str) -> str:
    section, name = dotted.split(".")
    why = WHY.get(dotted)
    return f"{dotted}={getattr(getattr(config, section), name)!r}" + (f" ({why})" if why else "")


KEPT_FROM_RUN = ("make_vocab_size_divisible_by", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                 "moe_router_load_balancing_type", "moe_expert_capacity_factor", "moe_token_drop_policy",
                 "moe_pad_expert_input_to_capacity", "moe_router_bias_update_rate", "moe_router_force_load_balancing",
                 "mtp_loss_scaling_factor")
"""Model fields an HF config.json does not decide (how the run trains the MoE and weighs the MTP loss, our
vocabulary padding):
--load-hf keeps the run's values."""


def _model_from_hf(config: Config, explicit: set[str]) -> list:
    """--load-hf DIR: the model section is the HF config.json's but for KEPT_FROM_RUN; a model field
    the user set to something else is replaced, with a warning."""
    hf = config_from_hf(config.checkpoint.load_hf)
    hf = replace(hf, **{name: getattr(config.model, name) for name in KEPT_FROM_RUN})
    warnings = [Problem(f"model.{f.name}", getattr(config.model, f.name), f"checkpoint.load_hf's config.json says "
                        f"{getattr(hf, f.name)!r}; this value is replaced", "drop it", "warning")
                for f in fields(hf) if f"model.{f.name}" in explicit and getattr(config.model, f.name) != getattr(hf, f.name)]
    note = unread_note(config.checkpoint.load_hf, hf)  # layers past the main and MTP ones
    if note:
        warnings.append(Problem("checkpoint.load_hf", config.checkpoint.load_hf, note, "applied", "warning"))
    config.model = hf
    return warnings


def is_file(path: str) -> bool:
    """Path(path).is_file(), False for a name the OS refuses (too long, a NUL byte)."""
    try:
        return Path(path).is_file()
    except (OSError, ValueError):
        return False


def _read_text(p: Path) -> str:
    try:
        data = p.read_bytes()
    except OSError as e:
        raise UserError(f"config file {p}: cannot read it ({e.strerror})") from None
    bad = "a NUL byte" if b"\0" in data else None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = f"byte 0x{data[e.start]:02x} at offset {e.start} is not UTF-8"
    if bad:
        raise UserError(f"config file {p} is not a text file ({bad}): a config is YAML, or a .txt of "
                        "flags / key=value words, in UTF-8")
    return text


def _check_cluster(config: Config, explicit: set[str]) -> None:
    """Sizes >= 1, and a world size given beside a node count must equal nodes x GPUs per node (one node
    may use fewer of its GPUs)."""
    c = config.cluster
    for name in ("num_nodes", "gpus_per_node", "world_size"):
        v = getattr(c, name)
        if v is not None and v < 1:
            raise UserError(f"cluster.{name}={v}: must be a whole number >= 1")
    # One node may run on part of its GPUs (torchrun --nproc-per-node 2 on an 8-GPU node); several
    # nodes are filled GPU by GPU, so their world size is exactly nodes x GPUs per node.
    partial_node = c.num_nodes == 1 and c.world_size is not None and c.world_size < c.gpus_per_node
    if "cluster.world_size" in explicit and "cluster.num_nodes" in explicit and c.world_size is not None \
            and c.world_size != c.num_nodes * c.gpus_per_node and not partial_node:
        n, g, w = c.num_nodes, c.gpus_per_node, c.world_size
        other = f" or num_nodes={w // g}" if w % g == 0 else ""
        raise UserError(f"cluster.world_size={w} disagrees with cluster.num_nodes x gpus_per_node = {n} x {g} "
                        f"= {n * g} (from the config, --world-size / --nodes / --gpus-per-node, or torchrun's "
                        f"--nnodes); give one: world_size={n * g}{other}, or drop the node count")


def read_words(text: str) -> list[str]:
    """Words of a shell-like text: comments dropped, backslash-newline joins lines."""
    lines = [line.split("#", 1)[0] if not line.lstrip().startswith("#!") else "" for line in
             text.replace("\\\n", " ").splitlines()]
    return shlex.split(" ".join(lines))


# Names that head a section in some dialect: empty, with keys after them, they mean lost indentation.
_SECTION_WORDS = set(SECTIONS) | {"actor", "trainer", "policy", "megatron_config", "megatron", "cfg"}


def _flatten(data: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    keys = list(data)
    for i, (k, v) in enumerate(data.items()):
        key = f"{prefix}{k}"
        if v is None and str(k) in _SECTION_WORDS:
            if i + 1 == len(keys) or isinstance(data[keys[i + 1]], dict):
                continue  # an empty section
            after = ", ".join(map(str, keys[i + 1:i + 4])) + (", ..." if len(keys) > i + 4 else "")
            raise UserError(f"'{key}:' is empty and the keys after it ({after}) sit beside it instead of "
                            f"under it: the YAML's indentation was probably lost when it was copied. Indent "
                            f"the keys that belong to '{k}' by two more spaces, e.g.\n  {k}:\n    {keys[i + 1]}: ...")
        if isinstance(v, dict):
            out += _flatten(v, key + ".")
        else:
            out.append((key, v))
    return out


MAX_DEPTH = 64
"""Deeper nesting is refused before parsing: no config nests this deep, and PyYAML recurses per level."""


def _nesting(text: str) -> int:
    """An upper bound on the nesting depth of a YAML text: open brackets, or indentation / 2."""
    depth = deepest = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    indent = max((len(line) - len(line.lstrip(" ")) for line in text.splitlines()), default=0)
    return max(deepest, indent // 2)


class _UniqueKeys(yaml.SafeLoader):
    """yaml.SafeLoader refusing a key given twice in one mapping: PyYAML keeps the last one silently (a
    second `training:` section replaced the first whole); OmegaConf, which Megatron-Bridge, RLinf and
    SkyRL read their YAML with, refuses it too. Keys merged in with `<<` may be overridden."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line + 1)
                except TypeError:  # an unhashable key: SafeLoader's own message
                    break
                if first != key_node.start_mark.line + 1:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping", node.start_mark,
                        f"found the key {key!r} again (first on line {first}): give each key once",
                        key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def parse_yaml(p: Path, text: str | None = None) -> dict | None:
    """The YAML config file `p` (or its `text`, already read) as a mapping of sections, None when empty;
    UserError naming what is wrong (not UTF-8, not YAML, nested too deep, not a mapping)."""
    text = _read_text(p) if text is None else text
    if _nesting(text) > MAX_DEPTH:
        raise UserError(f"{p}: nested deeper than {MAX_DEPTH} levels; a config is a few sections of keys")
    try:
        data = yaml.load(text, Loader=_UniqueKeys)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        raise UserError(f"{p}: not valid YAML: {e}") from None
    except (ValueError, RecursionError) as e:  # an integer of > 4300 digits; nesting deeper than Python's stack
        raise UserError(f"{p}: not a config YAML can read ({type(e).__name__}: {str(e)[:120]})") from None
    if data is not None and not isinstance(data, dict):
        raise UserError(f"{p}: expected a mapping of sections at the top level")
    return data


def _apply_yaml(config: Config, p: Path, text: str, explicit: set, dialects: list, special: dict,
                refusals: Refusals, key_notes: list[str]) -> None:
    data = parse_yaml(p, text)
    if data is None:
        return
    for key in SPECIAL_KEYS:
        if key in data:
            special[key] = data.pop(key)
    try:
        flat = _flatten(data)
    except RecursionError:
        raise UserError(f"{p}: nested too deeply to be a config") from None
    for key, value in flat:
        dialect, taken_notes = take(config, key, value, explicit, refusals)
        dialects += [dialect] if dialect else []
        key_notes += taken_notes


def _one_half_precision(words: list[str], source: str) -> list[str]:
    """`words`, refused where one command line gives both --bf16 and --fp16, as Megatron-LM asserts (the
    later one won, silently); a file's and the command line's may differ (the command line overrides)."""
    if "--bf16" in words and "--fp16" in words:
        raise UserError(f"{source}: --bf16 and --fp16 are both given; Megatron-LM refuses them together: keep one")
    return words


def _apply_words(config: Config, words: list[str], explicit: set, dialects: list, special: dict,
                 notes: list[Problem], switches: set[str], refusals: Refusals, key_notes: list[str]) -> None:
    words = _strip_launcher(config, words, explicit, notes)
    i = 0
    while i < len(words):
        if is_flag(words[i]):
            j = i + 1
            while j < len(words) and (is_flag(words[j]) or "=" not in words[j]):
                j += 1
            pairs, megatron, taken = parse_flags(words[i:j])
            if megatron:
                dialects.append(MEGATRON)
            if taken:
                notes.append(Problem("megatron flags", len(taken), "accepted without effect here: "
                                     + "; ".join(taken), "nothing to do", "warning"))
            for name, dotted, value in pairs:
                if dotted is None:
                    switches.add(name)
                else:
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
            dialect, taken_notes = take(config, key.lstrip("+"), value, explicit, refusals)  # Hydra's `+key=value` adds a key
            dialects += [dialect] if dialect else []
            key_notes += taken_notes
        i += 1


def _strip_launcher(config: Config, words: list[str], explicit: set, notes: list[Problem]) -> list[str]:
    """Read and drop a leading `torchrun [options] script` (fivefold.config.torchrun)."""
    words, settings, taken = strip_launcher(words)
    for dotted, value in settings:
        set_value(config, dotted, value, explicit)
    if taken:
        notes.append(Problem("torchrun options", len(taken), "accepted without effect here: " + "; ".join(taken),
                             "nothing to do", "warning"))
    return words
