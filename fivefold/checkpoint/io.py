"""Save and load sharded checkpoints (safetensors + JSON; nothing is pickled).

Every rank that holds a distinct parameter shard writes it (under DP only the first DP replica writes);
each rank writes its RNG state (fivefold.checkpoint.rng). Loading assembles each rank's shard from
whichever saved shards overlap it, so a checkpoint can be loaded into another sharding of the same
global tensors.

A checkpoint whose parameters hold a NaN or inf (a run with the non-finite check off) is marked by a
NONFINITE file listing them, and never rotates out the newest finite checkpoint: that one is kept
beside the `keep` newest, however many worse ones follow.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from fivefold.checkpoint.checksum import expected, merge_sums, sums_of_written, verify_metadata, write_sums, write_metadata
from fivefold.checkpoint.layout import (FORMAT, ShardSpec, complete_checkpoints, foreign_format, resolve, source_name,
                                        step_dir, whole)
from fivefold.checkpoint.metadata import check_metadata, resume_step
from fivefold.checkpoint.optim_state import MAIN, ShardOf, load_optim, merge_listings, save_optim
from fivefold.checkpoint.reshard import Reader, checkpoint_source, entry_source, fill, fill_flat
from fivefold.checkpoint.rng import check_rng_files, load_rng_state, rng_file, rng_state
from fivefold.config.schema import ModelConfig
from fivefold.errors import UserError, write_failed
from fivefold.parallel.optimizer import OptimShard, whole_shards
from fivefold.parallel.param_meta import named_metas


def buffers_saved(model: nn.Module) -> dict[str, torch.Tensor]:
    """The persistent buffers of `model` by name (the MoE routers' expert bias): state a resume needs
    that is not a parameter. Checkpoints hold them whole beside the parameters (no optimizer state);
    loading a checkpoint without one keeps its initial value, with a warning."""
    transient = {id(b) for m in model.modules() for name, b in m._buffers.items()
                 if name in m._non_persistent_buffers_set}
    return {name: b for name, b in model.named_buffers() if id(b) not in transient}


def tensors_saved(model: nn.Module) -> dict[str, torch.Tensor]:
    """Everything a checkpoint holds of `model`: its parameters, then its persistent buffers."""
    return {**dict(model.named_parameters()), **buffers_saved(model)}


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
    """One safetensors file, synced, and its checksums beside it (folded into metadata.json on commit)."""
    held = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(held, str(path))
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    write_sums(path, sums_of_written(path, held))


def save_checkpoint(root: str | Path, step: int, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                    rank: int, writes_params: bool, barrier: Callable[[], None], extra: dict,
                    shard_of: ShardOf | None = None, keep: int = 2,
                    optim_shards: list[OptimShard] | None = None, writes_optim: bool | None = None,
                    defer: Callable[[dict, Path], None] | None = None,
                    all_ok: Callable[[bool], bool] = lambda ok: ok) -> Path:
    """Write checkpoint `step` under `root` on every rank (collective: all ranks call it); returns its folder.

    `writes_params`: this rank writes its parameter shards (False on DP replicas > 0).
    `shard_of`: where a parameter sits in the global tensor (default: from its ParamMeta).
    `optim_shards`: the ranges the optimizer keeps state for (default: every parameter whole);
    `writes_optim`: this rank writes them (default `writes_params`; every rank under ZeRO-1).
    `extra`: JSON-able run state (data position, config) stored in metadata.json by rank 0.
    The new checkpoint and the `keep` - 1 before it are kept; older steps are deleted after the new one
    lands (steps above `step`, an earlier run's or a branch resumed from an older step, are left alone).
    `defer` (async save, fivefold.checkpoint.async_save): each tensor file is handed to it as host
    copies instead of written, and the checkpoint is not committed: the caller writes the files, then
    calls `commit_checkpoint` on every rank.
    `all_ok(ok)`: whether every rank wrote its files (a collective): a write that fails on one rank (a
    full disk) ends the save on every rank with the message, its folder removed, `latest` unchanged.
    """
    root = Path(root)
    shard_of = shard_of or placed_by_meta(model)
    final, tmp = step_dir(root, step), _tmp_dir(root, step)
    write = _save if defer is None else (lambda tensors, path: defer(_host_copies(tensors), path))
    failed = None
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
        except OSError as e:
            failed = write_failed(tmp, e, f"checkpoint {step}")
    barrier()
    try:
        if failed is None:
            _write_files(tmp, rank, model, optimizer, shard_of, write, writes_params, optim_shards, writes_optim)
    except OSError as e:
        failed = write_failed(e.filename or tmp, e, f"checkpoint {step}; {_latest_note(root)}")
    agreed = all_ok(failed is None)
    if not agreed:  # every rank has stopped writing: the partial folder goes
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise failed or PeerFailed(f"checkpoint {step}: another rank could not write its files (its message says "
                                   f"why); {_latest_note(root)}")
    if defer is None:
        commit_checkpoint(root, step, rank=rank, barrier=barrier, extra=extra, keep=keep, all_ok=all_ok)
    return final


class PeerFailed(UserError):
    """This rank stopped because another one failed, whose own error says why."""


def _latest_note(root: Path) -> str:
    latest = root / "latest"
    return f"{latest.read_text().strip()} stays latest" if latest.is_file() else "no checkpoint was written"


def _write_files(tmp: Path, rank: int, model: nn.Module, optimizer, shard_of: ShardOf, write, writes_params: bool,
                 optim_shards: list[OptimShard] | None, writes_optim: bool | None) -> None:
    """This rank's files of a checkpoint being saved into `tmp` (save_checkpoint)."""
    tag = f"{rank:05d}"
    write(rng_state(), tmp / rng_file(rank))
    if writes_params:
        params, shards = {}, {}
        buffers = buffers_saved(model)
        for name, p in tensors_saved(model).items():
            params[name] = p
            spec = shard_of(name, p)
            shards[name] = {"file": f"model-{tag}.safetensors", "offsets": list(spec.offsets),
                            "shape": list(p.shape), "global_shape": list(spec.global_shape), "dtype": str(p.dtype),
                            **({"buffer": True} if name in buffers else {})}
        write(params, tmp / f"model-{tag}.safetensors")
        (tmp / f"shards-{tag}.json").write_text(json.dumps(shards))
        bad = [name for name, p in params.items() if not bool(torch.isfinite(p).all())]
        if bad:
            (tmp / f"nonfinite-{tag}.json").write_text(json.dumps(bad))
    if writes_params if writes_optim is None else writes_optim:
        save_optim(tmp, tag, model, optimizer, whole_shards(model) if optim_shards is None else optim_shards,
                   shard_of, write)


def commit_checkpoint(root: str | Path, step: int, *, rank: int, barrier: Callable[[], None], extra: dict,
                      keep: int = 2, all_ok: Callable[[bool], bool] = lambda ok: ok) -> Path:
    """Once every rank's files of checkpoint `step` are written (collective): rank 0 writes the metadata
    and renames the folder into place (`latest` names it from then on). A commit that cannot write
    ends on every rank (`all_ok`), the folder removed, `latest` unchanged."""
    root = Path(root)
    barrier()
    failed = None
    if rank == 0:
        tmp = _tmp_dir(root, step)
        try:
            _commit(root, tmp, step_dir(root, step), step, extra, keep)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            (root / ".latest.tmp").unlink(missing_ok=True)
            failed = write_failed(e.filename or tmp, e, f"checkpoint {step}; {_latest_note(root)}")
    if not all_ok(failed is None):
        raise failed or PeerFailed(f"checkpoint {step}: rank 0 could not commit it (its message says why)")
    barrier()
    return step_dir(root, step)


def _tmp_dir(root: Path, step: int) -> Path:
    return root / f".tmp-{step_dir(root, step).name}"


def _host_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies a background writer may hold while training changes the originals."""
    return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}


def _commit(root: Path, tmp: Path, final: Path, step: int, extra: dict, keep: int) -> None:
    params: dict[str, dict] = {}
    merge_listings(tmp, "shards", params, "shards")
    merge_listings(tmp, "optimshards", params, "optim_shards")
    meta = {"format": FORMAT, "step": step, "params": params, **extra, "checksums": merge_sums(tmp)}
    bad = _merge_nonfinite(tmp)
    write_metadata(tmp, meta)
    _fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    _fsync_dir(root)
    # this run's line only: a step folder above `step` is not older, and deleting by step number alone
    # once rotated out the checkpoint just written (a run at step 1 into a root holding steps 2 and 4),
    # leaving `latest` naming nothing
    line = [c for c in complete_checkpoints(root) if c.name <= final.name]  # step_%08d: names sort as steps
    kept = _newest_finite(line)
    for old in line[:-keep]:
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


def read_metadata(path: str | Path, what: str = "--load") -> tuple[Path, dict]:
    """(checkpoint folder, its metadata) for a folder or a root; UserError when there is none (`what`:
    how the command names the path: a flag, or its positional argument)."""
    found = resolve(path)
    if found is None:
        raise UserError(f"{what} {path}: no complete checkpoint there (a folder with metadata.json, or a root "
                        f"with step_* folders){foreign_format(Path(path))}")
    file = found / "metadata.json"
    try:
        text = file.read_bytes()
        verify_metadata(found, text)
        meta = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{file}: not valid JSON ({e}); the checkpoint is damaged: load the one "
                        "before it") from None
    check_metadata(meta, file)
    return found, meta


def _fits(saved: list[int], mine: list[int], real: int | None) -> bool:
    """Equal global shapes, or the same vocabulary padded to another multiple (Megatron pads to
    make_vocab_size_divisible_by x TP, so TP4 and TP2 differ): rows at or past the parameter's
    `vocab_rows` (`real`, from its ParamMeta) are padding, zero on both sides."""
    return saved == mine or (real is not None and saved[1:] == mine[1:] and min(saved[0], mine[0]) >= real)


PARAMETER_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                    "kv_channels", "vocab_size", "normalization", "tie_word_embeddings", "multi_latent_attention",
                    "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "num_experts",
                    "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_first_k_dense_layers",
                    "activation", "add_bias_linear", "add_qkv_bias", "qk_layernorm", "qk_layernorm_scope",
                    "mtp_num_layers")
"""The model fields that decide which parameters the one-process model has and their shapes (the rest,
e.g. norm epsilon, RoPE base, router and loss coefficients, change no parameter). A checkpoint whose
config lacks one (saved before it was a field) holds its default. Until 2026-11-29 the last six were
missing: a checkpoint with QK norms, QKV biases or an MTP layer loaded into a model without them, its
extra tensors dropped without a word."""


@dataclass(frozen=True)
class Held:
    """A tensor of a model as `check_fits` compares it with a checkpoint's: its one-process (global)
    shape, the rows of it that are vocabulary (past them: padding), whether it is a buffer (which a
    checkpoint may lack)."""

    global_shape: tuple[int, ...]
    vocab_rows: int | None = None
    buffer: bool = False


def held_by(model: nn.Module, shard_of: ShardOf) -> dict[str, Held]:
    """What `model` holds, each tensor placed by `shard_of`."""
    metas, buffers = named_metas(model), buffers_saved(model)
    return {name: Held(tuple(shard_of(name, p).global_shape), metas[name].vocab_rows if name in metas else None,
                       name in buffers) for name, p in tensors_saved(model).items()}


ANOTHER_MODEL_FIX = ("give the model settings it was saved with: loading and `convert` change the layout, never the "
                     "model (to train another model, start without --load)")


def check_fits(meta: dict, model: nn.Module | Mapping[str, Held], shard_of: ShardOf | None, where: Path,
               model_config: dict | None = None, *, fix: str = ANOTHER_MODEL_FIX) -> None:
    """UserError listing every way the checkpoint holds another model: a parameter of this rank
    missing from it or of another global shape (beyond vocabulary padding), or, given this run's
    `model_config` (the canonical `model` section) and a checkpoint that stored its own, a
    parameter-deciding field that differs. The checkpoint's parameters this rank does not hold are
    another pipeline stage's (any layout loads any other): without `model_config` (or a checkpoint
    without its config), they are compared by name, which only holds when this rank holds the whole
    model. `model`: a module (its tensors placed by `shard_of`) or what one holds (`held_by`, or a
    model described without building it: `export`); `fix`: the advice the message ends with."""
    held = model if isinstance(model, Mapping) else held_by(model, shard_of)
    saved = meta["params"]
    problems = []
    theirs = meta.get("config", {}).get("model")
    if model_config is not None and theirs is not None:  # first: they say why the shapes below differ
        default = {f.name: f.default for f in fields(ModelConfig)}
        problems += [f"model.{f} is {theirs.get(f, default[f])!r} in the checkpoint, {model_config.get(f, default[f])!r} "
                     "here" for f in PARAMETER_FIELDS if theirs.get(f, default[f]) != model_config.get(f, default[f])]
    else:
        problems += [f"{n} is in the checkpoint but not in this model" for n, e in saved.items()
                     if n not in held and not e.get("buffer")]
    for name, h in held.items():
        g = list(h.global_shape)
        src = source_name(name, saved)
        if src not in saved:
            if not h.buffer:  # a buffer the checkpoint lacks keeps its initial value (_load_params)
                problems.append(f"{name} is not in the checkpoint")
        elif not _fits(saved[src]["global_shape"], g, h.vocab_rows):
            problems.append(f"{name} has shape {saved[src]['global_shape']} in the checkpoint, {g} in this model")
    if problems:
        shown = "\n  ".join(problems[:8]) + (f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise UserError(f"checkpoint {where} was saved from another model:\n  {shown}\n{fix}")


def assemble(folder: Path, meta: dict, entry: dict, key: str, out: torch.Tensor, spec: ShardSpec) -> bool:
    """Fill `out` (at spec.offsets of the global tensor) from one parameter entry's shards: whether
    they cover it (fivefold.checkpoint.reshard.fill, for callers reading one parameter at a time)."""
    with Reader(expected(folder, meta)) as reader, torch.no_grad():
        return fill(out, spec, entry_source(folder, key, entry), reader)


def _load_params(folder: Path, meta: dict, model: nn.Module, shard_of: ShardOf) -> None:
    """Each parameter from the saved shards that overlap it, reading only the overlaps
    (fivefold.checkpoint.reshard.fill; each file opened once). A 16-bit checkpoint loaded into fp32
    parameters takes the fp32 main copies it saved, where it has them, not its rounded weights."""
    weights = checkpoint_source(folder, meta)
    mains = checkpoint_source(folder, meta, "optim_shards", f".{MAIN}")
    missing = [n for n in buffers_saved(model) if n not in meta["params"]]
    if missing:
        print(f"warning: checkpoint {folder} was saved without {len(missing)} buffer(s) of this model (first: "
              f"{missing[0]}): they keep their initial value (the MoE expert bias: zero)", file=sys.stderr, flush=True)
    with Reader(expected(folder, meta)) as reader, torch.no_grad():
        for name, p in tensors_saved(model).items():
            if name in missing:
                continue
            spec = shard_of(name, p)
            src = source_name(name, meta["params"])
            if not fill(p.data, spec, weights[src], reader):
                raise UserError(f"checkpoint {folder}: its shards do not cover parameter {name}")
            if p.dtype == torch.float32 and meta["params"][src]["dtype"] != str(torch.float32):
                main = fill_flat(tuple(p.shape), spec, (0, p.numel()), mains[src], reader)
                if main is not None:
                    p.copy_(main.view_as(p))


def check_resume(folder: Path, meta: dict, *, world_size: int, load_rng: bool) -> None:
    """What a resume (`train --load` without --finetune) of checkpoint `folder` reads besides the
    tensors, checked before any rank starts: the step it continues at (`resume_step`) and, at the
    saved world size unless `load_rng` is off, every rank's RNG state (`load_checkpoint` would refuse
    a missing one on its rank, once all had started)."""
    resume_step(meta, folder)
    if load_rng:
        check_rng_files(folder, meta, world_size)


def load_checkpoint(path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None, rank: int,
                    world_size: int, shard_of: ShardOf | None = None, optim_shards: list[OptimShard] | None = None,
                    model_config: dict | None = None, load_rng: bool = True) -> dict:
    """Load parameters, AdamW moments (for `optim_shards`, default every parameter whole; any saved
    sharding; none when `optimizer` is None) and (same world size, `load_rng`) this rank's RNG; returns
    the metadata. `model_config`: this run's canonical model section, which decides "another model"
    (`check_fits`) on a rank that holds part of the model (a pipeline stage)."""
    folder, meta = read_metadata(path)
    shard_of = shard_of or placed_by_meta(model)
    check_fits(meta, model, shard_of, folder, model_config)
    if rank == 0 and not expected(folder, meta):
        print(f"note: checkpoint {folder} was saved without checksums (by an earlier fivefold): loaded unverified",
              file=sys.stderr, flush=True)
    if (folder / NONFINITE).exists() and rank == 0:
        print(f"warning: loading {folder}, whose parameters hold non-finite values (listed in its {NONFINITE})",
              file=sys.stderr, flush=True)
    _load_params(folder, meta, model, shard_of)
    with torch.no_grad():
        if optimizer is not None and meta.get("optimizer_step"):
            load_optim(folder, meta, model, optimizer, whole_shards(model) if optim_shards is None else optim_shards,
                       shard_of)
    if load_rng:
        load_rng_state(folder, meta, rank, world_size)
    return meta
