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
(fivefold.config.precision), saved the same way under "<name>.main"; a checkpoint without them (saved
in fp32) gives each main copy its parameter's loaded values. Checkpoints from before this file (moments shaped like the parameter shard,
named by "optim_file" in the parameter's shards) read as ranges covering their whole shard.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from fivefold.checkpoint.checksum import expected
from fivefold.checkpoint.layout import ShardSpec, source_name
from fivefold.checkpoint.reshard import Reader, checkpoint_source, fill_flat
from fivefold.errors import UserError
from fivefold.parallel.optimizer import OptimShard

MOMENTS = ("exp_avg", "exp_avg_sq")
MAIN = "main"


def _is_copy(key: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether the optimizer steps a copy of p's range (16-bit parameters, offload), not p's storage."""
    return key.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
ShardOf = Callable[[str, torch.Tensor], ShardSpec]


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
            if s.get("buffer"):  # not a parameter (fivefold.checkpoint.io.buffers_saved)
                entry["buffer"] = True
            listed = entry.setdefault(key, [])
            item = {k: s[k] for k in ("file", "offsets", "shape", "flat") if k in s}
            if not any({**x, "file": None} == {**item, "file": None} for x in listed):
                listed.append(item)
        frag.unlink()


def load_optim(folder: Path, meta: dict, model: nn.Module, optimizer, shards: list[OptimShard],
               shard_of: ShardOf) -> None:
    """Set optimizer.state[key] = {exp_avg, exp_avg_sq, step} for every range in `shards`, each read
    from the saved ranges that overlap it, only over the window of each that can meet it
    (fivefold.checkpoint.reshard.fill_flat)."""
    params = dict(model.named_parameters())
    sources = {m: checkpoint_source(folder, meta, "optim_shards", f".{m}") for m in (*MOMENTS, MAIN)}
    weights = checkpoint_source(folder, meta)
    # torch's fused AdamW (the GPU's, fivefold.parallel.optimizer) keeps its step count on the parameter's
    # device, the per-tensor one on the CPU
    fused = {id(p) for g in optimizer.param_groups if g.get("fused") for p in g["params"]}
    with Reader(expected(folder, meta)) as reader:
        for s in shards:
            p = params[s.name]
            spec = shard_of(s.name, p)
            src = source_name(s.name, meta["params"])  # a pipeline's tied head copy: the embedding's state
            state = {}
            for m in MOMENTS:
                t = fill_flat(tuple(p.shape), spec, s.flat, sources[m][src], reader)
                if t is None:
                    raise UserError(f"checkpoint {folder}: optimizer state {m} of {s.name} is missing")
                state[m] = t.to(device=s.key.device, dtype=s.key.dtype).view_as(s.key)
            state["step"] = torch.tensor(float(meta["optimizer_step"]), dtype=torch.float32,
                                         device=s.key.device if id(s.key) in fused else "cpu")
            optimizer.state[s.key] = state
            if _is_copy(s.key, p):  # the fp32 main copy: saved, else the saved weights (fp32 when saved in fp32)
                main = fill_flat(tuple(p.shape), spec, s.flat, sources[MAIN][src], reader)
                if main is None:
                    main = fill_flat(tuple(p.shape), spec, s.flat, weights[src], reader)
                s.key.data.copy_(main.view_as(s.key))
