"""AdamW moments in a checkpoint, sharded any way: whole parameters, TP shards, or ZeRO-1 chunks.

The optimizer keeps state for tensors that are a flat range [lo, hi) of a parameter as this rank
holds it (its TP shard, or the whole tensor): the whole range without the distributed optimizer,
the part of its DP chunk with it. Each such range is saved flat (1-D) under "<name>.exp_avg" /
"<name>.exp_avg_sq" in optim-<rank>.safetensors and listed in metadata.json under the parameter:

  "optim_shards": [{"file": "optim-00002.safetensors", "offsets": [0, 64], "shape": [128, 64],
                    "flat": [2048, 8192]}]

(offsets and shape: the rank's shard of the global tensor, as for parameters; flat: the range of
that shard, flattened, the saved tensor covers). Loading rebuilds each target range from every saved
range that overlaps it, so state saved at one DP size / with or without ZeRO / with one TP size
loads into any other. With 16-bit parameters the optimizer steps fp32 main copies
(fivefold.parallel.precision), saved the same way under "<name>.main"; a checkpoint without them (saved
in fp32) gives each main copy its parameter's loaded values. Checkpoints from before this file (moments shaped like the parameter shard,
named by "optim_file" in the parameter's shards) read as ranges covering their whole shard.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fivefold.checkpoint.layout import ShardSpec, inside, open_shard, overlap, source_name
from fivefold.errors import UserError

MOMENTS = ("exp_avg", "exp_avg_sq")
MAIN = "main"


def _is_copy(key: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether the optimizer steps a copy of p's range (16-bit parameters, offload), not p's storage."""
    return key.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
ShardOf = Callable[[str, torch.Tensor], ShardSpec]


@dataclass(frozen=True)
class OptimShard:
    """A tensor the optimizer keeps state for: [lo, hi) of parameter `name` flattened."""

    name: str
    key: torch.Tensor
    """The tensor optimizer.state is keyed by."""
    flat: tuple[int, int]


def whole_shards(model: nn.Module) -> list[OptimShard]:
    """The plain optimizer's: each parameter whole."""
    return [OptimShard(n, p, (0, p.numel())) for n, p in model.named_parameters()]


def save_optim(folder: Path, tag: str, model: nn.Module, optimizer, shards: list[OptimShard],
               shard_of: ShardOf, save: Callable[[dict, Path], None]) -> None:
    """Write this rank's moments (optim-<tag>.safetensors) and their listing (optimshards-<tag>.json)."""
    params = dict(model.named_parameters())
    tensors, listing = {}, {}
    for s in shards:
        state = optimizer.state.get(s.key, {})
        if not all(m in state for m in MOMENTS):
            continue  # no step taken yet
        p = params[s.name]
        spec = shard_of(s.name, p)
        for m in MOMENTS:
            tensors[f"{s.name}.{m}"] = state[m].reshape(-1)
        if p.dtype != torch.float32 and _is_copy(s.key, p):
            tensors[f"{s.name}.{MAIN}"] = s.key.detach().reshape(-1)
        listing[s.name] = {"file": f"optim-{tag}.safetensors", "offsets": list(spec.offsets), "shape": list(p.shape),
                           "flat": list(s.flat), "global_shape": list(spec.global_shape), "dtype": str(p.dtype)}
    save(tensors, folder / f"optim-{tag}.safetensors")
    (folder / f"optimshards-{tag}.json").write_text(json.dumps(listing))


def merge_listings(folder: Path, prefix: str, params: dict[str, dict], key: str) -> None:
    """Fold every rank's `prefix`-*.json fragment into the metadata's parameter entries, under `key`
    ("shards" for parameters, "optim_shards" for moments). A range listed by several ranks (a
    TP-replicated parameter is written by every TP rank) is listed once: same offsets, shape, flat."""
    for frag in sorted(folder.glob(f"{prefix}-*.json")):
        for name, s in json.loads(frag.read_text()).items():
            entry = params.setdefault(name, {"global_shape": s["global_shape"], "dtype": s["dtype"], "shards": []})
            listed = entry.setdefault(key, [])
            item = {k: s[k] for k in ("file", "offsets", "shape", "flat") if k in s}
            if not any({**x, "file": None} == {**item, "file": None} for x in listed):
                listed.append(item)
        frag.unlink()


def _saved_ranges(entry: dict) -> list[dict]:
    if "optim_shards" in entry:
        return entry["optim_shards"]
    return [{"file": s["optim_file"], "offsets": s["offsets"], "shape": s["shape"], "flat": [0, math.prod(s["shape"])]}
            for s in entry["shards"] if "optim_file" in s]


def _assemble_range(folder: Path, entry: dict, key: str, spec: ShardSpec, shape: tuple[int, ...],
                    flat: tuple[int, int]) -> torch.Tensor | None:
    """[lo, hi) of the flattened target shard (at spec.offsets, `shape`) of moment `key`, or None
    when the saved ranges do not cover it. Each saved range is placed in its own shard's box; the
    part of that box inside the target box is copied where the saved range has values. Target
    elements past the saved global shape (vocabulary padding) are padding: zero, not required."""
    out = torch.zeros(shape)
    have = torch.zeros(shape, dtype=torch.bool)
    for s in _saved_ranges(entry):
        where = overlap(spec.offsets, shape, s["offsets"], s["shape"])
        if where is None:
            continue
        with open_shard(folder, s["file"]) as f:
            if key not in f.keys():
                continue
            values = f.get_tensor(key).reshape(-1)
        box, mask = torch.zeros(s["shape"]), torch.zeros(s["shape"], dtype=torch.bool)
        box.view(-1)[s["flat"][0]: s["flat"][1]] = values
        mask.view(-1)[s["flat"][0]: s["flat"][1]] = True
        src, dst = where
        out[dst] = torch.where(mask[src], box[src], out[dst])
        have[dst] |= mask[src]
    required = torch.zeros(shape, dtype=torch.bool)
    required[inside(spec.offsets, shape, entry["global_shape"])] = True
    if not bool(have.view(-1)[flat[0]: flat[1]][required.view(-1)[flat[0]: flat[1]]].all()):
        return None
    return out.view(-1)[flat[0]: flat[1]].clone()


def load_optim(folder: Path, meta: dict, model: nn.Module, optimizer, shards: list[OptimShard],
               shard_of: ShardOf) -> None:
    """Set optimizer.state[key] = {exp_avg, exp_avg_sq, step} for every range in `shards`."""
    params = dict(model.named_parameters())
    for s in shards:
        p = params[s.name]
        spec = shard_of(s.name, p)
        src = source_name(s.name, meta["params"])  # a pipeline's tied head copy: the embedding's state
        state = {}
        for m in MOMENTS:
            t = _assemble_range(folder, meta["params"][src], f"{src}.{m}", spec, tuple(p.shape), s.flat)
            if t is None:
                raise UserError(f"checkpoint {folder}: optimizer state {m} of {s.name} is missing")
            state[m] = t.to(device=s.key.device, dtype=s.key.dtype).view_as(s.key)
        state["step"] = torch.tensor(float(meta["optimizer_step"]))
        optimizer.state[s.key] = state
        if _is_copy(s.key, p):
            main = _assemble_range(folder, meta["params"][src], f"{src}.{MAIN}", spec, tuple(p.shape), s.flat)
            if main is None:
                main = p.detach().reshape(-1)[s.flat[0]: s.flat[1]]
            s.key.data.copy_(main.view_as(s.key))
