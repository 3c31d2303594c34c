"""Save and load sharded checkpoints (safetensors + JSON; nothing is pickled).

Every rank that holds a distinct parameter shard writes it (under DP only the first DP replica
writes); each rank writes its RNG state. Loading assembles each rank's shard from whichever saved
shards overlap it, so a checkpoint can be loaded into another sharding of the same global tensors.

A checkpoint whose parameters hold a NaN or inf (a run with the non-finite check off) is marked by a
NONFINITE file listing them, and never rotates out the newest finite checkpoint: that one is kept
beside the `keep` newest, however many worse ones follow.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from fivefold.checkpoint.layout import FORMAT, ShardSpec, complete_checkpoints, resolve, step_dir, whole
from fivefold.checkpoint.optim_state import (MAIN, OptimShard, ShardOf, load_optim, merge_listings, save_optim,
                                             whole_shards)
from fivefold.checkpoint.refusals import check_files, check_safetensors, why_not_a_checkpoint
from fivefold.checkpoint.reshard import Reader, checkpoint_source, fill_flat, load_params, tied_aliases
from fivefold.errors import UserError
from fivefold.parallel.param_meta import named_metas


def placed_by_meta(model: nn.Module) -> ShardOf:
    """Where each parameter of `model` sits in the one-process tensor, from its metadata: TP / ETP
    shards at their offset, the rest whole (the default `shard_of`)."""
    metas = named_metas(model)

    def shard_of(name: str, t: torch.Tensor) -> ShardSpec:
        return ShardSpec(*metas[name].placement(tuple(t.shape))) if name in metas else whole(t.shape)
    return shard_of

NONFINITE = "NONFINITE"
"""In a checkpoint folder: the JSON list of parameters that hold a NaN or inf."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def rng_state() -> dict[str, torch.Tensor]:
    state = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


Write = Callable[[dict[str, torch.Tensor], Path], None]
"""Writes a dict of tensors as one safetensors file (`_save`; the async saver's collects a copy)."""


def write_rank_files(root: Path, step: int, *, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int,
                     writes_params: bool, barrier: Callable[[], None], shard_of: ShardOf | None = None,
                     optim_shards: list[OptimShard] | None = None, writes_optim: bool | None = None,
                     write: Write = _save) -> Path:
    """This rank's part of checkpoint `step` (collective: rank 0 makes the .tmp folder first): its
    RNG, parameter shards and optimizer ranges through `write`, their listings as JSON. Returns the
    .tmp folder (see save_checkpoint for the arguments)."""
    shard_of = shard_of or placed_by_meta(model)
    tmp = root / f".tmp-{step_dir(root, step).name}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    tag = f"{rank:05d}"
    write(rng_state(), tmp / f"rng-{tag}.safetensors")
    if writes_params:
        params, shards = {}, {}
        for name, p in model.named_parameters():
            params[name] = p
            spec = shard_of(name, p)
            shards[name] = {"file": f"model-{tag}.safetensors", "offsets": list(spec.offsets),
                            "shape": list(p.shape), "global_shape": list(spec.global_shape), "dtype": str(p.dtype)}
        write(params, tmp / f"model-{tag}.safetensors")
        (tmp / f"shards-{tag}.json").write_text(json.dumps(shards))
        bad = [name for name, p in params.items() if not bool(torch.isfinite(p).all())]
        if bad:
            (tmp / f"nonfinite-{tag}.json").write_text(json.dumps(bad))
    if writes_params if writes_optim is None else writes_optim:
        save_optim(tmp, tag, model, optimizer, whole_shards(model) if optim_shards is None else optim_shards,
                   shard_of, write)
    return tmp


def commit_checkpoint(root: Path, step: int, *, rank: int, barrier: Callable[[], None], extra: dict,
                      keep: int = 2) -> Path:
    """Once every rank's files are written (collective): rank 0 merges the listings into
    metadata.json, renames .tmp-step_N to step_N, points `latest` at it and rotates old ones."""
    final = step_dir(root, step)
    barrier()
    if rank == 0:
        _commit(root, root / f".tmp-{final.name}", final, step, extra, keep)
    barrier()
    return final


def save_checkpoint(root: str | Path, step: int, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                    rank: int, writes_params: bool, barrier: Callable[[], None], extra: dict,
                    shard_of: ShardOf | None = None, keep: int = 2,
                    optim_shards: list[OptimShard] | None = None, writes_optim: bool | None = None) -> Path:
    """Write checkpoint `step` under `root` on every rank (collective: all ranks call it); returns its folder.

    `writes_params`: this rank writes its parameter shards (False on DP replicas > 0).
    `shard_of`: where a parameter sits in the global tensor (default: from its ParamMeta).
    `optim_shards`: the ranges the optimizer keeps state for (default: every parameter whole);
    `writes_optim`: this rank writes them (default `writes_params`; every rank under ZeRO-1).
    `extra`: JSON-able run state (data position, config) stored in metadata.json by rank 0.
    The `keep` newest complete checkpoints are kept; older ones are deleted after the new one lands.
    (fivefold.checkpoint.async_save writes the same files from a background thread.)
    """
    root = Path(root)
    write_rank_files(root, step, model=model, optimizer=optimizer, rank=rank, writes_params=writes_params,
                     barrier=barrier, shard_of=shard_of, optim_shards=optim_shards, writes_optim=writes_optim)
    return commit_checkpoint(root, step, rank=rank, barrier=barrier, extra=extra, keep=keep)


def _commit(root: Path, tmp: Path, final: Path, step: int, extra: dict, keep: int) -> None:
    params: dict[str, dict] = {}
    merge_listings(tmp, "shards", params, "shards")
    merge_listings(tmp, "optimshards", params, "optim_shards")
    meta = {"format": FORMAT, "step": step, "params": params, **extra}
    bad = _merge_nonfinite(tmp)
    (tmp / "metadata.json").write_text(json.dumps(meta, indent=1))
    _fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    _fsync_dir(root)
    kept = _newest_finite(complete_checkpoints(root))
    for old in complete_checkpoints(root)[:-keep]:
        if old != kept:
            shutil.rmtree(old, ignore_errors=True)
    if bad:
        left = f"the newest finite checkpoint, {kept}, is kept" if kept else "no finite checkpoint is left"
        print(f"warning: checkpoint {final} holds non-finite values in {len(bad)} parameters (first: {bad[0]}); {left}",
              file=sys.stderr, flush=True)


def _merge_nonfinite(tmp: Path) -> list[str]:
    """Fold the ranks' nonfinite-*.json lists into tmp/NONFINITE (none when every parameter is finite)."""
    bad: set[str] = set()
    for frag in sorted(tmp.glob("nonfinite-*.json")):
        bad.update(json.loads(frag.read_text()))
        frag.unlink()
    if bad:
        (tmp / NONFINITE).write_text(json.dumps(sorted(bad)))
    return sorted(bad)


def _newest_finite(checkpoints: list[Path]) -> Path | None:
    finite = [c for c in checkpoints if not (c / NONFINITE).exists()]
    return finite[-1] if finite else None


def read_metadata(path: str | Path) -> tuple[Path, dict]:
    """(checkpoint folder, its metadata) for a folder or a root; UserError when there is none."""
    found = resolve(path)
    if found is None:
        raise UserError(why_not_a_checkpoint(Path(path)))
    meta = json.loads((found / "metadata.json").read_text())
    check_files(found, meta)
    return found, meta


def _fits(saved: list[int], mine: list[int], real: int | None) -> bool:
    """Equal global shapes, or the same vocabulary padded to another multiple (Megatron pads to
    make_vocab_size_divisible_by x TP, so TP4 and TP2 differ): rows at or past the parameter's
    `vocab_rows` (`real`, from its ParamMeta) are padding, zero on both sides."""
    return saved == mine or (real is not None and saved[1:] == mine[1:] and min(saved[0], mine[0]) >= real)


def check_fits(meta: dict, model: nn.Module, shard_of: ShardOf, where: Path,
               whole_names: set[str] | None = None) -> None:
    """UserError listing every parameter whose global shape differs (beyond vocabulary padding), that
    this rank holds and the checkpoint lacks, or that the checkpoint holds and no rank of the model
    does (`whole_names`: every rank's parameter names, fivefold.checkpoint.names; default this
    model's, for a model held whole)."""
    saved = meta["params"]
    aliases = tied_aliases(meta)
    problems = []
    metas = named_metas(model)
    for name, p in model.named_parameters():
        g = list(shard_of(name, p).global_shape)
        key = name if name in saved else aliases.get(name, name)
        if key not in saved:
            problems.append(f"{name} is not in the checkpoint")
        elif not _fits(saved[key]["global_shape"], g, metas[name].vocab_rows):
            problems.append(f"{name} has shape {saved[key]['global_shape']} in the checkpoint, {g} in this model")
    mine = whole_names if whole_names is not None else {n for n, _ in model.named_parameters()}
    problems += [f"{n} is in the checkpoint but not in this model" for n in saved
                 if n not in mine and aliases.get(n) not in mine]
    if problems:
        shown = "\n  ".join(problems[:8]) + (f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise UserError(f"checkpoint {where} was saved from another model:\n  {shown}\n"
                        "load it with the model settings it was saved with, or start without --load")


def _load_params(folder: Path, meta: dict, model: nn.Module, shard_of: ShardOf) -> None:
    """Each parameter from the saved shards that overlap it (only those byte ranges are read). A
    16-bit checkpoint loaded into fp32 parameters takes the fp32 main copies it saved, where it has them."""
    aliases = tied_aliases(meta)
    params = dict(model.named_parameters())
    specs = {n: shard_of(n, p) for n, p in params.items()}
    load_params(params, specs, checkpoint_source(folder, meta), f"checkpoint {folder}", aliases=aliases)
    mains = checkpoint_source(folder, meta, "optim_shards", f".{MAIN}")
    with Reader() as reader, torch.no_grad():
        for name, p in params.items():
            key = name if name in mains else aliases.get(name, name)
            if p.dtype != torch.float32 or meta["params"][key]["dtype"] == "torch.float32":
                continue
            main = fill_flat(tuple(p.shape), specs[name], (0, p.numel()), mains[key], reader)
            if main is not None:
                p.copy_(main.view_as(p))


def load_checkpoint(path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None, rank: int,
                    world_size: int, shard_of: ShardOf | None = None,
                    optim_shards: list[OptimShard] | None = None, whole_names: set[str] | None = None) -> dict:
    """Load parameters, AdamW moments (for `optim_shards`, default every parameter whole; any saved
    sharding) and (same world size) this rank's RNG; returns the metadata. `whole_names`: the
    parameter names of the whole model when this rank holds a part (see check_fits)."""
    folder, meta = read_metadata(path)
    shard_of = shard_of or placed_by_meta(model)
    check_fits(meta, model, shard_of, folder, whole_names)
    if (folder / NONFINITE).exists() and rank == 0:
        print(f"warning: loading {folder}, whose parameters hold non-finite values (listed in its {NONFINITE})",
              file=sys.stderr, flush=True)
    _load_params(folder, meta, model, shard_of)
    if optimizer is not None and meta.get("optimizer_step"):
        with torch.no_grad():
            load_optim(folder, meta, model, optimizer, whole_shards(model) if optim_shards is None else optim_shards,
                       shard_of)
    rng = folder / f"rng-{rank:05d}.safetensors"
    if meta.get("world_size") == world_size and rng.is_file():
        check_safetensors(rng)
        with safe_open(str(rng), framework="pt") as f:
            torch.set_rng_state(f.get_tensor("torch_cpu"))
            if "torch_cuda" in f.keys() and torch.cuda.is_available():
                torch.cuda.set_rng_state(f.get_tensor("torch_cuda"))
    return meta
