"""Checksums of a checkpoint's files: silent corruption (a flipped bit on disk, a bad copy) is refused
on load, naming the file and the tensor, never trained on.

CRC-32 (zlib.crc32): it detects every error burst of up to 32 bits, so every single flipped byte,
which is the fault to catch (a disk or a copy, not an adversary: nothing here is a signature), and
is the fastest checksum in the standard library (several GB/s; blake2b is a few times slower).

Each safetensors file of a checkpoint is recorded in its metadata.json under `checksums.files`:
  "model-00003.safetensors": {"header": [nbytes, crc], "tensors": {"layers.0.mlp.fc1.weight": [crc, ...]}}
`header` covers the file's first `nbytes` bytes (the 8-byte length and the JSON header); each tensor's
data is checksummed in blocks of CHUNK_BYTES, so a reader verifies exactly the blocks it reads: a
resharded load that reads a few rows of a tensor checks the one or two blocks they lie in, not the
whole file. metadata.json itself is checksummed by the file METADATA_SUM beside it.

A checkpoint saved before checksums (no METADATA_SUM and no `checksums` key) loads unverified.
"""
from __future__ import annotations

import json
import os
import zlib
from collections.abc import Mapping
from pathlib import Path

import torch

from fivefold.errors import UserError

ALGORITHM = "crc32"
CHUNK_BYTES = 1 << 20
"""Bytes of tensor data per checksum: a reader reads at most one block more at each end of a range."""
METADATA_SUM = "metadata.crc32"
"""Beside metadata.json: `crc32 <hex> <bytes>` of metadata.json."""
SUMS_SUFFIX = ".sums.json"
"""A rank's checksums of one file it wrote, `<file>.sums.json`, folded into metadata.json on commit."""

FileSums = dict
"""{"header": [nbytes, crc], "tensors": {key: [crc per CHUNK_BYTES block]}}."""


def _damaged(folder: Path, file: str, what: str) -> UserError:
    return UserError(f"checkpoint {folder}: {file}: {what} does not match its checksum: the file is damaged (on disk "
                     "or in a copy); load the checkpoint before it, or copy this one again from where it was saved")


def block_sums(data) -> list[int]:
    """CRC-32 of each CHUNK_BYTES block of `data` (bytes-like; one block for no bytes)."""
    view = memoryview(data).cast("B")
    return [zlib.crc32(view[i:i + CHUNK_BYTES]) for i in range(0, max(len(view), 1), CHUNK_BYTES)]


def tensor_sums(t: torch.Tensor) -> list[int]:
    """`block_sums` of the bytes safetensors stores for `t`, each block copied into a scratch buffer first:
    `Tensor.numpy()` makes a storage non-resizable for good, and ZeRO-3 frees its gathered parameters by
    resizing their storage to 0 after the save."""
    flat = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    if not flat.numel():
        return block_sums(b"")
    scratch = torch.empty(min(CHUNK_BYTES, flat.numel()), dtype=torch.uint8)
    out = []
    for i in range(0, flat.numel(), CHUNK_BYTES):
        block = scratch[: min(CHUNK_BYTES, flat.numel() - i)]
        block.copy_(flat[i:i + CHUNK_BYTES])
        out.append(zlib.crc32(memoryview(block.numpy())))
    return out


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes safetensors stores for `t` (a contiguous CPU tensor), without a copy; its storage is then
    not resizable (`tensor_sums` for tensors that are freed by resizing)."""
    t = t.detach().contiguous().cpu()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _header(fd: int) -> bytes:
    n = int.from_bytes(os.pread(fd, 8, 0), "little")
    return os.pread(fd, 8 + n, 0) if n < (1 << 30) else b""


def sums_of_written(path: Path, tensors: Mapping[str, torch.Tensor]) -> FileSums:
    """The checksums of a safetensors file just written from `tensors` (their bytes as held in memory,
    the truth the file should hold; its header as read back)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        header = _header(fd)
    finally:
        os.close(fd)
    return {"header": [len(header), zlib.crc32(header)],
            "tensors": {k: tensor_sums(t) for k, t in tensors.items()}}


def write_sums(path: Path, sums: FileSums) -> None:
    """A rank's record of the file `path` it wrote, beside it until the commit folds it in."""
    path.with_name(path.name + SUMS_SUFFIX).write_text(json.dumps(sums))


def merge_sums(folder: Path) -> dict:
    """The `checksums` entry of metadata.json from the `*.sums.json` records in `folder` (removed)."""
    files = {}
    for record in sorted(folder.glob(f"*{SUMS_SUFFIX}")):
        files[record.name[:-len(SUMS_SUFFIX)]] = json.loads(record.read_text())
        record.unlink()
    return {"algorithm": ALGORITHM, "chunk_bytes": CHUNK_BYTES, "files": files}


def write_metadata(folder: Path, meta: dict) -> None:
    """metadata.json and its checksum (METADATA_SUM)."""
    text = json.dumps(meta, indent=1).encode()
    (folder / "metadata.json").write_bytes(text)
    (folder / METADATA_SUM).write_text(f"{ALGORITHM} {zlib.crc32(text):08x} {len(text)}\n")


def verify_metadata(folder: Path, text: bytes) -> None:
    """UserError when metadata.json's bytes `text` do not match METADATA_SUM; nothing to check for a
    checkpoint saved before checksums (neither the file nor a `checksums` key)."""
    file = folder / METADATA_SUM
    try:
        recorded = file.read_text().split()
    except FileNotFoundError:
        if b'"checksums"' in text:
            raise UserError(f"checkpoint {folder}: {METADATA_SUM} (metadata.json's checksum) is missing; copy the "
                            "whole checkpoint folder, or load the checkpoint before it") from None
        return
    except (OSError, UnicodeDecodeError):
        recorded = []
    ok = len(recorded) == 3 and recorded[0] == ALGORITHM and recorded[1] == f"{zlib.crc32(text):08x}" \
        and recorded[2] == str(len(text))
    if not ok:
        raise _damaged(folder, "metadata.json", f"its content ({METADATA_SUM})")


def expected(folder: Path, meta: dict) -> dict[Path, FileSums]:
    """Path -> its recorded checksums, for a Reader (fivefold.checkpoint.reshard); {} when unrecorded."""
    record = meta.get("checksums")
    if not isinstance(record, dict):
        return {}
    if record.get("algorithm") != ALGORITHM or record.get("chunk_bytes") != CHUNK_BYTES:
        raise UserError(f"checkpoint {folder}: checksums by {record.get('algorithm')!r} in blocks of "
                        f"{record.get('chunk_bytes')!r} bytes, not {ALGORITHM!r} in {CHUNK_BYTES}: written by "
                        "another fivefold version")
    return {folder / name: sums for name, sums in record.get("files", {}).items()}


def check_header(path: Path, fd: int, sums: FileSums) -> None:
    """UserError naming `path` when its header bytes are not the ones recorded."""
    n, crc = sums["header"]
    if zlib.crc32(os.pread(fd, n, 0)) != crc:
        raise _damaged(path.parent, path.name, "its header")


def read_verified(path: Path, fd: int, sums: FileSums, key: str, data_start: int, nbytes: int,
                  lo: int, hi: int) -> bytearray:
    """Bytes [lo, hi) of tensor `key` (its data at file offset `data_start`, `nbytes` long), read as
    whole checksummed blocks and verified; UserError naming the file and the tensor on a mismatch."""
    crcs = sums["tensors"].get(key)
    if crcs is None:
        raise _damaged(path.parent, path.name, f"tensor {key} (not in the recorded checksums)")
    a = lo // CHUNK_BYTES * CHUNK_BYTES
    b = min(-(-hi // CHUNK_BYTES) * CHUNK_BYTES, nbytes)
    data = os.pread(fd, b - a, data_start + a)
    view = memoryview(data)
    for k in range(a // CHUNK_BYTES, max(-(-b // CHUNK_BYTES), 1)):
        start = k * CHUNK_BYTES - a
        if k >= len(crcs) or zlib.crc32(view[start:start + CHUNK_BYTES]) != crcs[k]:
            raise _damaged(path.parent, path.name, f"tensor {key} (bytes {k * CHUNK_BYTES}-"
                                                   f"{min((k + 1) * CHUNK_BYTES, nbytes)})")
    return bytearray(view[lo - a:hi - a])


def verify_file(path: Path, sums: FileSums) -> int:
    """Every byte of safetensors file `path` against `sums`; the bytes verified. UserError naming the
    file (and the tensor) that does not match, or a file missing."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise UserError(f"checkpoint {path.parent}: {path.name} is missing (a rank's file; copy the whole "
                        "checkpoint folder, or load the checkpoint before it)") from None
    try:
        check_header(path, fd, sums)
        n = sums["header"][0]
        header = json.loads(os.pread(fd, n - 8, 8))
        keys = set(header) - {"__metadata__"}
        if keys != set(sums["tensors"]):
            raise _damaged(path.parent, path.name, "its list of tensors")
        for key in keys:  # a block at a time: memory holds one block, not a whole tensor
            lo, hi = header[key]["data_offsets"]
            for start in range(0, max(hi - lo, 1), CHUNK_BYTES):
                read_verified(path, fd, sums, key, n + lo, hi - lo, start, min(start + CHUNK_BYTES, hi - lo))
        if os.fstat(fd).st_size != n + max((header[k]["data_offsets"][1] for k in keys), default=0):
            raise _damaged(path.parent, path.name, "its length")
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def verify_checkpoint(folder: Path, meta: dict) -> tuple[int, int] | None:
    """Every file of checkpoint `folder` (its metadata.json verified and read: io.read_metadata)
    against its checksums: (files, bytes) verified, or None for a checkpoint saved without checksums.
    UserError naming the first file (and tensor) that does not match, or a file the metadata lists that
    has no checksum."""
    files = expected(folder, meta)
    if not files:
        return None
    listed = {s[k] for e in meta["params"].values() for kind in ("shards", "optim_shards")
              for s in e.get(kind, []) for k in ("file", "optim_file") if k in s}
    unsummed = sorted(name for name in listed if folder / name not in files)
    if unsummed:
        raise _damaged(folder, unsummed[0], "a file metadata.json lists with no checksum recorded: metadata.json")
    total = sum(verify_file(path, sums) for path, sums in sorted(files.items()))
    return len(files), total
