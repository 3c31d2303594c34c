"""Fill this rank's tensors from a store of full (global) tensors held in pieces, reading only the
byte ranges each rank needs: any saved layout into any loaded one.

A *source* maps a global tensor's name to where its values lie: `Saved(global_shape, dtype, pieces)`,
each `Piece` a rectangular block of the global tensor (at `offsets`, of `shape`) stored as the
tensor `key` of the safetensors file `file`, optionally only a flat range [lo, hi) of that block
(ZeRO chunks of optimizer state). Our checkpoints give one piece per saved shard
(`checkpoint_source`); a Hugging Face folder gives one whole piece per tensor through a name map
(`hf_source`), or several for a tensor we hold fused (QKV: one piece per projection, at its rows).

A *destination* is a tensor held the way its `ParamMeta` says (`meta.placement`: a TP / ETP shard at
its offsets, or the whole tensor). `fill` copies into it the part of every piece that overlaps it:
the rows of the piece that the overlap spans are read from the file with positioned reads
(`_File`), never the whole tensor unless the overlap needs every row. Rows at or past the destination's `vocab_rows` that the source does not have
(vocabulary padded to another multiple) are padding: zero. `fill_flat` does the same for a flat range
of the destination (a ZeRO chunk of optimizer state), reading of each flat-saved piece only the
window that can meet it.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from fivefold.checkpoint.checksum import FileSums, check_header, read_verified
from fivefold.checkpoint.layout import ShardSpec, inside, open_shard, overlap
from fivefold.errors import UserError
from fivefold.parallel.param_meta import PLAIN, ParamMeta


@dataclass(frozen=True)
class Piece:
    """A block of a global tensor stored in a safetensors file: the block at `offsets` of `shape`,
    stored whole as tensor `key`, or (`flat` = (lo, hi)) only its flattened elements [lo, hi)."""

    file: Path
    key: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    flat: tuple[int, int] | None = None


@dataclass(frozen=True)
class Saved:
    """One global tensor of a source: its shape and dtype as stored, and the pieces that hold it."""

    global_shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]


Source = Mapping[str, Saved]
"""Name -> where it is stored."""


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class _File:
    """One safetensors file read with positioned reads (os.pread) of just the bytes asked for: the
    pages are this process's own buffers, freed with them, not memory-mapped pages of the whole file
    that stay resident while it is open. The header is checked by safetensors once (open_shard). With
    the file's recorded checksums (`sums`, fivefold.checkpoint.checksum), its header and every block of
    tensor data read are verified."""

    def __init__(self, path: Path, sums: FileSums | None = None):
        self.path, self.sums = path, sums
        if sums is not None:  # first: a damaged header is named as such, not as whatever it parses to
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                fd = None  # open_shard names it
            if fd is not None:
                try:
                    check_header(path, fd, sums)
                finally:
                    os.close(fd)
        with open_shard(path.parent, path.name) as f:  # a missing or damaged file: UserError naming it
            self.keys = set(f.keys())
        self.fd = os.open(path, os.O_RDONLY)
        n = int.from_bytes(os.pread(self.fd, 8, 0), "little")
        self.header = json.loads(os.pread(self.fd, n, 8))
        self.base = 8 + n

    def _bytes(self, key: str, lo: int, hi: int) -> bytearray:
        """Bytes [lo, hi) of tensor `key`'s data (verified, with checksums)."""
        begin, end = self.header[key]["data_offsets"]
        if self.sums is None:
            return bytearray(os.pread(self.fd, hi - lo, self.base + begin + lo))
        return read_verified(self.path, self.fd, self.sums, key, self.base + begin, end - begin, lo, hi)

    def read(self, key: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """tensor[slices]: the rows of dim 0 that `slices` spans are read whole, the rest cut from them."""
        entry = self.header[key]
        dtype, shape = _DTYPES[entry["dtype"]], list(entry["shape"])
        if not shape:
            return torch.frombuffer(self._bytes(key, 0, dtype.itemsize), dtype=dtype)[0]
        first = slices[0] if slices else slice(None)
        lo, hi, _ = first.indices(shape[0])
        row = math.prod(shape[1:]) * dtype.itemsize
        data = self._bytes(key, lo * row, hi * row) if hi > lo and row else bytearray()
        rows = torch.frombuffer(data, dtype=dtype).view(hi - lo, *shape[1:]) if data else \
            torch.empty(0, *shape[1:], dtype=dtype)
        return rows[(slice(None), *slices[1:])]

    def close(self) -> None:
        os.close(self.fd)


class Reader:
    """Open safetensors files, each opened once however many pieces are read from it (`_File`), each
    read verified against its checksums where `sums` (path -> its record: checksum.expected) has them."""

    def __init__(self, sums: Mapping[Path, FileSums] | None = None):
        self._open: dict[Path, _File] = {}
        self._sums = sums or {}

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def file(self, path: Path) -> _File:
        if path not in self._open:
            self._open[path] = _File(path, self._sums.get(path))
        return self._open[path]

    def has(self, piece: Piece) -> bool:
        return piece.key in self.file(piece.file).keys

    def read(self, piece: Piece, slices: tuple[slice, ...]) -> torch.Tensor:
        """The elements `slices` of the piece (of its flat range, with `flat`), read from the file."""
        return self.file(piece.file).read(piece.key, slices)


def spec_of(meta: ParamMeta, t: torch.Tensor) -> ShardSpec:
    """Where a tensor held as `meta` says sits in the global tensor."""
    return ShardSpec(*meta.placement(tuple(t.shape)))


def fill(out: torch.Tensor, spec: ShardSpec, saved: Saved, reader: Reader) -> bool:
    """Fill `out` (at spec.offsets of the global tensor) from the pieces that overlap it; elements
    past the saved global shape are zeroed. Whether every element inside the saved shape was found."""
    needed = out[inside(spec.offsets, out.shape, saved.global_shape)].numel()
    if needed < out.numel():
        out.zero_()
    filled = 0
    for piece in saved.pieces:
        if piece.flat is not None:
            raise ValueError(f"{piece.key}: a flat range is read with fill_flat")
        where = overlap(spec.offsets, out.shape, piece.offsets, piece.shape)
        if where is None:
            continue
        if not reader.has(piece):
            return False
        dst = out[where[1]]
        dst.copy_(reader.read(piece, where[0]))
        filled += dst.numel()
    return filled == needed


def _flat_index(box: tuple[int, ...], src: tuple[slice, ...]) -> torch.Tensor:
    """The flat index, in a block of shape `box`, of every element of its sub-block `src` (shaped like it)."""
    idx = torch.zeros((), dtype=torch.long)
    for d, s in enumerate(src):
        along = torch.arange(s.start, s.stop) * math.prod(box[d + 1:])
        idx = idx.unsqueeze(-1) + along  # (..., n_d)
    return idx


def _contiguous(box: tuple[int, ...], sub: tuple[slice, ...]) -> tuple[int, int] | None:
    """[first, last + 1) flat index of sub-block `sub` of a block `box` when the sub-block is one
    contiguous run of the flattened block (extent 1 before some dim, whole dims after it), else None."""
    ext = [s.stop - s.start for s in sub]
    k = 0
    while k < len(box) - 1 and ext[k] == 1:
        k += 1
    if any(ext[d] != box[d] for d in range(k + 1, len(box))):
        return None
    first = sum(s.start * math.prod(box[d + 1:]) for d, s in enumerate(sub))
    return first, first + math.prod(ext)


def fill_flat(shape: tuple[int, ...], spec: ShardSpec, flat: tuple[int, int], saved: Saved,
              reader: Reader) -> torch.Tensor | None:
    """Elements [lo, hi) of the flattened destination block (at spec.offsets, of `shape`), fp32, or
    None when the pieces do not cover them. Where the overlap is one contiguous run in both blocks
    (the same box, or boxes split along dim 0 only) it is one 1-D copy of the needed window;
    otherwise a flat-saved piece is read only over the window of its range that can meet the
    destination block. Elements past the saved global shape are padding: zero, not required."""
    lo, hi = flat
    out = torch.zeros(hi - lo)
    have = torch.zeros(hi - lo, dtype=torch.bool)
    for piece in saved.pieces:
        where = overlap(spec.offsets, shape, piece.offsets, piece.shape)
        if where is None or not reader.has(piece):
            continue
        src, dst = where
        plo, phi = piece.flat or (0, math.prod(piece.shape))
        runs = _contiguous(piece.shape, src), _contiguous(shape, dst)
        if runs[0] is not None and runs[1] is not None:  # overlap = src run [s0, ..) = dst run [d0, ..)
            (s0, s1), (d0, _) = runs
            a = max(s0, plo, lo - d0 + s0)  # in the piece's flat coordinates
            b = min(s1, phi, hi - d0 + s0)
            if a < b:
                window = reader.read(piece, (slice(a - plo, b - plo),)) if piece.flat else \
                    reader.read(piece, src).reshape(-1)[a - s0: b - s0]
                out[a - s0 + d0 - lo: b - s0 + d0 - lo] = window.float()
                have[a - s0 + d0 - lo: b - s0 + d0 - lo] = True
            continue
        block = torch.zeros(shape)
        got = torch.zeros(shape, dtype=torch.bool)
        if piece.flat is None:
            block[dst] = reader.read(piece, src).float()
            got[dst] = True
        else:
            idx = _flat_index(piece.shape, src)  # (overlap block): where each element is in the piece
            a, b = max(int(idx.min()), plo), min(int(idx.max()) + 1, phi)
            if a >= b:
                continue
            window = reader.read(piece, (slice(a - plo, b - plo),)).float()  # only the bytes that can meet us
            held = (idx >= a) & (idx < b)
            block[dst] = torch.where(held, window[(idx - a).clamp(0, b - a - 1)], block[dst])
            got[dst] = held
        got = got.view(-1)[lo:hi]
        out[got] = block.view(-1)[lo:hi][got]
        have |= got
    box = inside(spec.offsets, shape, saved.global_shape)
    if all(s.stop - s.start == n for s, n in zip(box, shape)):
        complete = bool(have.all())
    else:  # vocabulary padding the checkpoint did not have: only the real rows are required
        required = torch.zeros(shape, dtype=torch.bool)
        required[box] = True
        complete = bool(have[required.view(-1)[lo:hi]].all())
    return out if complete else None


def specs_of(tensors: Mapping[str, torch.Tensor], metas: Mapping[str, ParamMeta]) -> dict[str, ShardSpec]:
    """Where each destination tensor sits in its global tensor, from its ParamMeta (PLAIN: whole)."""
    return {n: spec_of(metas.get(n, PLAIN), t) for n, t in tensors.items()}


def load_params(tensors: Mapping[str, torch.Tensor], specs: Mapping[str, ShardSpec], source: Source,
                where: str, *, aliases: Mapping[str, str] | None = None) -> None:
    """Fill each destination tensor (name -> this rank's tensor, at specs[name] in the global tensor:
    `specs_of(tensors, metas)`) from `source`, reading only its own ranges. `aliases`: a name to read
    in place of one the source lacks (a tied output layer's copy reads the embedding). UserError
    naming what the source does not cover."""
    aliases = aliases or {}
    with Reader() as reader, torch.no_grad():
        for name, t in tensors.items():
            key = name if name in source else aliases.get(name, name)
            if key not in source:
                raise UserError(f"{where}: {name} is not in it")
            if not fill(t, specs[name], source[key], reader):
                raise UserError(f"{where}: its shards do not cover parameter {name} (a shard file is missing "
                                "or was written in part: load an earlier checkpoint)")


def checkpoint_source(folder: Path, meta: dict, kind: str = "shards", suffix: str = "") -> dict[str, Saved]:
    """Our checkpoint's tensors: `kind` "shards" (parameters) or "optim_shards" (optimizer ranges,
    the tensor `<name><suffix>`, e.g. ".exp_avg")."""
    return {name: entry_source(folder, name + suffix, entry, kind) for name, entry in meta["params"].items()}


def entry_source(folder: Path, key: str, entry: dict, kind: str = "shards") -> Saved:
    """Where tensor `key` of one metadata.json parameter entry is stored."""
    listed = entry.get(kind)
    if listed is None and kind == "optim_shards":  # before optim_shards: moments shaped like the shard
        listed = [{"file": s["optim_file"], "offsets": s["offsets"], "shape": s["shape"]}
                  for s in entry["shards"] if "optim_file" in s]
    pieces = tuple(Piece(folder / s["file"], key, tuple(s["offsets"]), tuple(s["shape"]),
                         tuple(s["flat"]) if "flat" in s else None) for s in listed or [])
    return Saved(tuple(entry["global_shape"]), entry["dtype"], pieces)


HFName = str | list[tuple[str, int]]
"""Where one of our tensors is in a Hugging Face folder: an HF tensor name (the whole tensor), or
[(HF name, row offset), ...] for one we hold as several HF tensors stacked along dim 0 (fused QKV)."""


def hf_source(folder: Path, name_map: Mapping[str, HFName]) -> dict[str, Saved]:
    """Our names -> the tensors of a Hugging Face safetensors folder (model.safetensors, or the
    shards a model.safetensors.index.json lists), reading only each file's header here."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    elif (folder / "model.safetensors").is_file():
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            files = dict.fromkeys(f.keys(), folder / "model.safetensors")
    else:
        raise UserError(f"{folder}: no model.safetensors or model.safetensors.index.json (a Hugging Face folder "
                        "saved with safe_serialization; re-save it with save_pretrained(..., safe_serialization=True))")
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in sorted(set(files.values())):
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():
                s = f.get_slice(k)
                shapes[k] = (tuple(s.get_shape()), s.get_dtype())
    out = {}
    for ours, theirs in name_map.items():
        parts = [(theirs, 0)] if isinstance(theirs, str) else list(theirs)
        missing = [k for k, _ in parts if k not in shapes or k not in files]
        if missing:
            raise UserError(f"{folder}: tensor {missing[0]} (for {ours}) is not in this folder's safetensors files")
        first_shape, dtype = shapes[parts[0][0]]
        pieces = tuple(Piece(files[k], k, (row, *[0] * (len(shapes[k][0]) - 1)), shapes[k][0]) for k, row in parts)
        rows = max(p.offsets[0] + p.shape[0] for p in pieces)
        out[ours] = Saved((rows, *first_shape[1:]), dtype, pieces)
    return out

