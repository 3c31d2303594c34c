"""The structure a checkpoint's metadata.json must have, checked once where every command reads it
(`fivefold.checkpoint.io.read_metadata`: train --load, convert, export), so a damaged file is one
message naming the file, the key and the problem, never a KeyError or TypeError deep in a load.

Required: `step` (an integer >= 0) and `params` (a non-empty object: per tensor its `global_shape`,
`dtype` and `shards`, each shard a file of the folder at `offsets` of `shape` inside the global
shape). Checked where present: `format`, `optimizer_step`, `world_size`, `data` (an object whose
`next_step`, the step a resume continues at, is an integer >= 0), `optim_shards`, and `config` (an
object of sections; the `model` section's keys those of ModelConfig, the fields `--load` compares and
`export` builds the model from).

`data` is optional: every save of `train` writes it (and `convert` keeps it), but a checkpoint saved by
a script calling save_checkpoint may have no data position; `export` and `convert` read such a one,
and `train --load` resumes it only as --finetune (`resume_step`).
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from fivefold.checkpoint.layout import FORMAT
from fivefold.config.schema import ModelConfig
from fivefold.errors import UserError

MODEL_FIELDS = frozenset(f.name for f in fields(ModelConfig))


def damaged(file: Path, problem: str) -> UserError:
    """The error for a metadata.json that cannot describe a checkpoint."""
    return UserError(f"{file}: {problem}; the checkpoint is damaged (use the one before it, or copy this one "
                     "again from where it was saved)")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ints(v, n: int | None = None) -> bool:
    """A list of integers >= 0 (of length n, when given)."""
    return isinstance(v, list) and all(_is_int(x) and x >= 0 for x in v) and (n is None or len(v) == n)


def _kind(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number")


def check_metadata(meta, file: Path) -> None:
    """UserError (`damaged`) for the first way `meta`, read from `file`, is not what a save writes."""
    if not isinstance(meta, dict):
        raise damaged(file, f"holds {_kind(meta)}, not an object with 'step' and 'params'")
    if meta.get("format", FORMAT) != FORMAT:
        raise UserError(f"{file}: format {meta['format']!r}, not {FORMAT!r}: not a checkpoint this fivefold "
                        "reads (written by another program or version)")
    for key in ("step", "params"):
        if key not in meta:
            raise damaged(file, f"has no {key!r} key")
    for key in ("step", "optimizer_step", "world_size"):
        if key in meta and not (_is_int(meta[key]) and meta[key] >= (1 if key == "world_size" else 0)):
            raise damaged(file, f"{key!r} is {meta[key]!r}, not a whole number")
    if "data" in meta:
        data = meta["data"]
        if not (isinstance(data, dict) and "next_step" in data):
            raise damaged(file, f"'data' is {data!r}, not an object with 'next_step' (the step a resume continues at)")
        if not (_is_int(data["next_step"]) and data["next_step"] >= 0):
            raise damaged(file, f"'data.next_step' is {data['next_step']!r}, not a whole number")
    params = meta["params"]
    if not isinstance(params, dict) or not params:
        raise damaged(file, f"'params' is {_kind(params) if params else repr(params)}, not an object listing the "
                            "saved tensors")
    for name, entry in params.items():
        problem = _entry_problem(entry)
        if problem:
            raise damaged(file, f"params[{name!r}] {problem}")
    _check_config(meta.get("config", {}), file)


def resume_step(meta: dict, where: Path) -> int:
    """The step a resume of checkpoint `where` continues at (`meta` checked by `check_metadata`): its
    `data.next_step`. A checkpoint saved without a data position is refused, naming --finetune (step 0
    from its weights), which reads none."""
    if "data" not in meta:
        raise UserError(f"checkpoint {where}: its metadata.json has no 'data.next_step' (the step a resume continues "
                        "at; every save of `train` writes it, this checkpoint was saved otherwise): give --finetune "
                        "(checkpoint.finetune=true) to start at step 0 from its weights")
    return meta["data"]["next_step"]


def _entry_problem(entry) -> str:
    """How one `params` entry is malformed, or ''."""
    if not isinstance(entry, dict):
        return f"is {_kind(entry)}, not an object"
    g = entry.get("global_shape")
    if not _ints(g):
        return f"has 'global_shape' {g!r}, not a list of sizes"
    if not isinstance(entry.get("dtype"), str):
        return f"has 'dtype' {entry.get('dtype')!r}, not a string such as 'torch.float32'"
    if not isinstance(entry.get("shards"), list):
        return f"has 'shards' {entry.get('shards')!r}, not a list"
    for kind in ("shards", "optim_shards"):
        listed = entry.get(kind, [])
        if not isinstance(listed, list):
            return f"has {kind!r} {listed!r}, not a list"
        for k, s in enumerate(listed):
            problem = _shard_problem(s, g)
            if problem:
                return f"{kind}[{k}] {problem}"
    return ""


def _shard_problem(s, global_shape: list[int]) -> str:
    """How one shard listing is malformed, or '': a file of the checkpoint's own folder (a name, no
    path: a listing never reads outside it), a block inside the global tensor."""
    if not isinstance(s, dict):
        return f"is {_kind(s)}, not an object"
    for key in ("file", "optim_file"):
        f = s.get(key, "x")
        if not isinstance(f, str) or not f or "/" in f or "\\" in f or f in (".", ".."):
            return f"has {key!r} {f!r}, not a file name in the checkpoint folder"
    n = len(global_shape)
    if not (_ints(s.get("offsets"), n) and _ints(s.get("shape"), n)):
        return (f"has offsets {s.get('offsets')!r} and shape {s.get('shape')!r}, not {n} sizes each (the "
                f"global shape is {global_shape})")
    if any(o + m > g for o, m, g in zip(s["offsets"], s["shape"], global_shape)):
        return f"at offsets {s['offsets']} of shape {s['shape']} lies outside the global shape {global_shape}"
    if "flat" in s:
        numel = 1
        for m in s["shape"]:
            numel *= m
        if not (_ints(s["flat"], 2) and s["flat"][0] <= s["flat"][1] <= numel):
            return f"has 'flat' {s['flat']!r}, not a range [lo, hi] within its {numel} elements"
    return ""


def _check_config(config, file: Path) -> None:
    if not isinstance(config, dict) or not all(isinstance(v, dict) for v in config.values()):
        raise damaged(file, "'config' is not an object of sections (model, parallel, training, ...)")
    unknown = sorted(set(config.get("model", {})) - MODEL_FIELDS)
    if unknown:
        raise damaged(file, f"config.model has {', '.join(map(repr, unknown[:3]))}, not fields of the model "
                            "config (docs/config.md)")
