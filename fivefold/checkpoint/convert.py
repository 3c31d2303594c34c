"""Reshard a checkpoint offline into the files another layout's ranks would write, one destination
rank at a time and tensor by tensor (bounded memory: one destination rank's parameters, plus one
tensor's optimizer range at a time; never the whole model unless one rank holds it).

For each rank of the destination layout that writes (DP x CP replica 0; for MoE also EDP replica 0,
as the training loop's save), its parameters are built on a *paper mesh* (the rank's groups, with no
process group behind them: building a model runs no collective), filled from the source's pieces
(fivefold.checkpoint.reshard: only the overlapping byte ranges are read), and written with a
streaming safetensors writer. The optimizer state (AdamW moments, fp32 main copies when the source
has them) is written per destination shard whole (the layout a run without ZeRO writes): every
ZeRO stage loads it, as it loads any saved ranges. RNG states are copied when the world size is
unchanged (a run at another world size starts fresh RNG streams, as --load does).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import struct
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from fivefold.checkpoint.checksum import (ALGORITHM, CHUNK_BYTES, FileSums, block_sums, expected, tensor_bytes,
                                          verify_file, write_metadata)
from fivefold.checkpoint.io import buffers_saved, check_fits, placed_by_meta, read_metadata, tensors_saved
from fivefold.checkpoint.layout import (FORMAT, TIED, ShardSpec, complete_checkpoints, resolve, source_name, step_dir,
                                        whole)
from fivefold.checkpoint.optim_state import MAIN, MOMENTS
from fivefold.checkpoint.reshard import Reader, checkpoint_source, fill, fill_flat, spec_of
from fivefold.checkpoint.rng import has_rng
from fivefold.config.schema import Config, to_dict
from fivefold.config.validate import layout_of
from fivefold.errors import UserError, write_failed
from fivefold.parallel.param_meta import named_metas
from fivefold.runtime.mesh import OWN_COMMUNICATOR, Group, Mesh
from fivefold.topology import Layout

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


def paper_mesh(layout: Layout, rank: int) -> Mesh:
    """Rank `rank`'s mesh of `layout` without process groups: enough to build its model's parameters
    (and their ParamMeta), not to run collectives."""
    named = dict(layout.named_groups())
    named["world"] = [list(range(layout.world_size))]
    named.update({name: named[of] for name, of in OWN_COMMUNICATOR.items()})
    groups = {name: Group(name, tuple(ranks), None, me=rank) for name, lists in named.items()
              for ranks in lists if rank in ranks}
    return Mesh(layout, rank, torch.device("cpu"), groups)


def write_streaming(path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                    produce: Callable[[str], torch.Tensor]) -> FileSums:
    """A safetensors file written tensor by tensor: the header from `entries` (name, dtype, shape)
    first, then `produce(name)` for each in turn, so only one tensor is in memory at a time; returns
    its checksums (fivefold.checkpoint.checksum)."""
    header, offset = {}, 0
    for name, dtype, shape in entries:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    sums = {"header": [len(head), zlib.crc32(head)], "tensors": {}}
    with open(path, "wb") as f:
        f.write(head)
        for name, dtype, shape in entries:
            t = produce(name).to(dtype).contiguous()
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: produced {tuple(t.shape)}, header says {shape}")
            data = tensor_bytes(t)
            sums["tensors"][name] = block_sums(data)
            f.write(data)
    return sums


def _writes(config: Config, mesh: Mesh) -> bool:
    """Whether this rank writes its parameters in a save (the training loop's rule)."""
    return mesh.dp_cp.rank == 0 or (config.model.is_moe and mesh.edp.rank == 0)


def _rank_params(config: Config, mesh: Mesh) -> Iterable[tuple[str, torch.Tensor]]:
    from fivefold.model import build_decoder
    from fivefold.config.batch_sizes import microbatches_per_step
    from fivefold.pipeline.stages import build_pipeline
    if mesh.layout.pp > 1:
        return build_pipeline(config, mesh, microbatches_per_step(config, mesh.dp.size), device=torch.device("cpu")).module
    return build_decoder(config, mesh)


def convert(src: str | Path, dst: str | Path, config: Config, *, log: Callable[[str], None] = print) -> Path:
    """Write checkpoint `src` (a folder or a root) as the ranks of `config`'s layout would, into the
    root `dst` (its step_N folder, `latest`); returns the new folder."""
    folder, meta = read_metadata(src, "SRC")
    layout = layout_of(config)
    out = step_dir(Path(dst), meta["step"])
    if (Path(dst) / "metadata.json").exists():  # a step folder, not a root: step_N and `latest` would go into it
        raise UserError(f"convert: DST {dst} is a checkpoint's step folder; give a destination root (a new or "
                        f"empty folder, or one holding other steps), e.g. {Path(dst).parent}-converted")
    if out.exists():
        raise UserError(f"convert: {out} exists; give an empty destination root")
    rngs = _rng_files(folder, meta, layout.world_size)
    tmp = out.parent / f".tmp-{out.name}"  # a save's own name for a folder being written (checkpoint.layout)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise write_failed(tmp, e, "the converted checkpoint") from None
    try:
        _write(folder, meta, config, layout, tmp, rngs, log)
        tmp.rename(out)
        _point_latest(out, log)
    except OSError as e:  # a full disk, a read-only folder: named, DST as it was
        shutil.rmtree(tmp, ignore_errors=True)
        (out.parent / ".latest.tmp").unlink(missing_ok=True)
        raise write_failed(e.filename or tmp, e, f"the converted checkpoint; {dst} is left as it was") from None
    except BaseException:  # an error or Ctrl-C leaves DST as it was
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _rng_files(folder: Path, meta: dict, world_size: int) -> list[Path]:
    """The RNG states to copy: every rank's at the same world size (another world size starts fresh
    streams, as --load does). One missing is refused, as a missing shard is: the copy would lack it,
    and --load of it would refuse then."""
    if not has_rng(meta, world_size):
        return []
    rngs = [folder / f"rng-{r:05d}.safetensors" for r in range(world_size)]
    missing = [p.name for p in rngs if not p.is_file()]
    if missing:
        named = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise UserError(f"convert: checkpoint {folder}: {named} {'is' if len(missing) == 1 else 'are'} missing (the "
                        "ranks' RNG states, copied at the same world size; copy the whole checkpoint folder)")
    return rngs


def _point_latest(out: Path, log: Callable[[str], None]) -> None:
    """`latest` names the converted step, unless --load DST loaded a newer one before (the one DST's
    `latest` names, or its newest without one): a later --load DST never silently goes back."""
    root, latest = out.parent, out.parent / "latest"
    try:
        current = resolve(root) if latest.is_file() else max(
            (c for c in complete_checkpoints(root) if c != out), default=None)
    except UserError:  # a `latest` naming nothing complete: the converted step replaces it
        current = None
    if current is not None and current.name > out.name:  # step_%08d: names sort as steps (`step_dir`)
        log(f"note: {root} holds {current.name}, newer than the converted {out.name}: --load {root} still loads "
            f"{current.name}; give --load {out} for this one")
        return
    (root / ".latest.tmp").write_text(out.name)
    os.replace(root / ".latest.tmp", latest)


def _write(folder: Path, meta: dict, config: Config, layout: Layout, tmp: Path, rngs: list[Path],
           log: Callable[[str], None]) -> None:
    """Every file of the converted checkpoint into `tmp`."""
    weights = checkpoint_source(folder, meta)
    moments = {m: checkpoint_source(folder, meta, "optim_shards", f".{m}") for m in (*MOMENTS, MAIN)}
    listing: dict[str, dict] = {}
    sums: dict[str, FileSums] = {}
    has_optim = bool(meta.get("optimizer_step"))
    with Reader(expected(folder, meta)) as reader, torch.no_grad():
        for rank in range(layout.world_size):
            mesh = paper_mesh(layout, rank)
            if not _writes(config, mesh):
                continue
            model = _rank_params(config, mesh)
            metas = named_metas(model)
            # buffers (the MoE expert bias): whole, no optimizer state, left out where the source has none
            buffers = buffers_saved(model)
            held = {n: p for n, p in tensors_saved(model).items() if n not in buffers or n in meta["params"]}
            specs = {n: spec_of(metas[n], p) if n in metas else whole(p.shape) for n, p in held.items()}
            # a block another destination rank already wrote (TP-replicated norms, dense weights on EDP ranks) is listed once
            params = {n: p for n, p in held.items() if not any(
                s["offsets"] == list(specs[n].offsets) and s["shape"] == list(p.shape)
                for s in listing.get(n, {}).get("shards", []))}
            if not params:
                continue
            check_fits(meta, model, placed_by_meta(model), folder, model_config=to_dict(config)["model"])
            keys = {n: source_name(n, meta["params"]) for n in params}
            tag = f"{rank:05d}"
            for n, p in params.items():
                if not fill(p.data, specs[n], weights[keys[n]], reader):
                    raise UserError(f"convert: the shards of {folder} do not cover {n}")
                e = listing.setdefault(n, {"global_shape": list(specs[n].global_shape), "dtype": str(p.dtype),
                                           "shards": [], **({"buffer": True} if n in buffers else {})})
                e["shards"].append({"file": f"model-{tag}.safetensors", "offsets": list(specs[n].offsets),
                                    "shape": list(p.shape)})
            sums[f"model-{tag}.safetensors"] = write_streaming(
                tmp / f"model-{tag}.safetensors", [(n, p.dtype, tuple(p.shape)) for n, p in params.items()],
                lambda n: params[n].data)
            if has_optim:
                sums[f"optim-{tag}.safetensors"] = _write_optim(
                    tmp / f"optim-{tag}.safetensors", {n: p for n, p in params.items() if n not in buffers},
                    specs, keys, moments, reader, listing)
            model = params = None  # freed before the next destination rank's are built
            log(f"destination rank {rank}: written")
    extra = [n for n, e in meta["params"].items() if n not in listing and TIED.get(n) not in listing
             and not e.get("buffer")]
    if extra:  # the model config matched (check_fits): a parameter no destination rank holds is a bug to report
        raise UserError(f"convert: {extra[0]} of {folder} is held by no rank of the destination layout")
    recorded = expected(folder, meta)
    for rng in rngs:  # verified where the source records it, then copied with its record
        if rng in recorded:
            verify_file(rng, recorded[rng])
        shutil.copyfile(rng, tmp / rng.name)
        if rng in recorded:
            sums[rng.name] = recorded[rng]
    kept = {k: v for k, v in meta.items() if k not in ("params", "format", "config", "world_size", "checksums")}
    write_metadata(tmp, {"format": FORMAT, **kept, "world_size": layout.world_size, "rng_saved": bool(rngs),
                         "params": listing, "config": to_dict(config), "converted_from": str(folder),
                         "checksums": {"algorithm": ALGORITHM, "chunk_bytes": CHUNK_BYTES, "files": sums}})


def _write_optim(path: Path, params: dict[str, torch.Tensor], specs: dict[str, ShardSpec], keys: dict[str, str],
                 moments: dict[str, dict], reader: Reader, listing: dict[str, dict]) -> FileSums:
    """Each parameter's moments (and fp32 main copy, where the source has one) as one flat range
    covering the destination shard, computed when the streaming writer reaches it."""
    entries, plan = [], {}
    for n, p in params.items():
        kinds = [*MOMENTS] + ([MAIN] if any(reader.has(q) for q in moments[MAIN][keys[n]].pieces) else [])
        for m in kinds:
            entries.append((f"{n}.{m}", torch.float32, (p.numel(),)))
            plan[f"{n}.{m}"] = (n, m)
        listing[n].setdefault("optim_shards", []).append(
            {"file": path.name, "offsets": list(specs[n].offsets), "shape": list(p.shape), "flat": [0, p.numel()]})

    def produce(key: str) -> torch.Tensor:
        n, m = plan[key]
        t = fill_flat(tuple(params[n].shape), specs[n], (0, params[n].numel()), moments[m][keys[n]], reader)
        if t is None:
            raise UserError(f"convert: optimizer state {m} of {n} is not covered by the source's ranges")
        return t
    return write_streaming(path, entries, produce)
