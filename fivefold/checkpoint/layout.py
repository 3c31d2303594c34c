"""On-disk layout of a checkpoint, independent of the layout that wrote it.

  ROOT/latest                      name of the newest complete checkpoint (replaced atomically)
  ROOT/step_00000010/metadata.json every parameter's global shape and dtype, and its shards:
                                   {"file", "offsets", "shape"} (offsets = where the shard starts in
                                   each dimension of the global tensor); step, data position, config
  ROOT/step_00000010/model-00003.safetensors   parameter shards written by rank 3
  ROOT/step_00000010/optim-00003.safetensors   AdamW moments, sharded like the parameters
  ROOT/step_00000010/rng-00003.safetensors     rank 3's RNG states (uint8 tensors, never pickled)
A folder being written is ROOT/.tmp-step_... and becomes step_... by one rename once complete, so a
run killed during a save leaves the previous checkpoint as `latest`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from fivefold.errors import UserError

FORMAT = "fivefold-checkpoint-1"


@dataclass(frozen=True)
class ShardSpec:
    """Where a rank's tensor sits inside the global tensor."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


def whole(shape) -> ShardSpec:
    """A tensor held whole (replicated, e.g. under DP)."""
    return ShardSpec(tuple(shape), tuple(0 for _ in shape))


def overlap(offsets, shape, saved_offsets, saved_shape) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """Where a saved shard (at `saved_offsets`, `saved_shape` in the global tensor) meets a target
    shard (at `offsets`, `shape`): (slices into the saved shard, slices into the target), or None."""
    lo = [max(a, b) for a, b in zip(offsets, saved_offsets)]
    hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, shape, saved_offsets, saved_shape)]
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return (tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, saved_offsets)),
            tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offsets)))


def inside(offsets, shape, global_shape) -> tuple[slice, ...]:
    """The part of a target shard (at `offsets`, `shape`) that lies inside a global tensor of
    `global_shape` (a checkpoint's, whose vocabulary rows may be padded less than the target's)."""
    return tuple(slice(0, max(0, min(n, g - o))) for o, n, g in zip(offsets, shape, global_shape))


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def is_complete(path: Path) -> bool:
    return (path / "metadata.json").is_file() and not path.name.startswith(".")


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if is_complete(p))


def resolve(path: str | Path) -> Path | None:
    """A checkpoint folder itself, or a root: the one `latest` names (a root without `latest`: the
    newest complete one); None when there is none.

    `latest` naming a folder that is not a complete checkpoint is a UserError, never a fall back to an
    older step: a save writes `latest` only once its folder is complete, so the folder was deleted or
    moved since, and loading another step would silently lose (or repeat) training. Megatron-LM
    likewise fails when the iteration latest_checkpointed_iteration.txt names cannot be loaded."""
    p = Path(path)
    if is_complete(p):
        return p
    found = complete_checkpoints(p)
    latest = p / "latest"
    if latest.is_file():
        try:
            name = latest.read_text().strip()
        except (OSError, UnicodeDecodeError):
            name = ""
        if name and "/" not in name and "\\" not in name and is_complete(p / name):
            return p / name
        there = (f"the newest complete checkpoint there is {found[-1].name}: give {found[-1]} to load it, or "
                 f"write {found[-1].name} into {latest}") if found else "there is no complete checkpoint there"
        raise UserError(f"{latest} names {name!r}, which is not a complete checkpoint folder of {p} "
                        f"(deleted or moved?); {there}")
    return found[-1] if found else None


TIED = {"head.weight": "embedding.weight"}
"""A pipeline's last stage holds its own copy of a tied output layer, `head.weight`; a one-process
model ties it to the embedding, and its checkpoint has only `embedding.weight`."""


def source_name(name: str, saved) -> str:
    """The checkpoint entry parameter `name` is read from: itself, or the tied weight it copies (a
    checkpoint without `head.weight` but with `embedding.weight` was saved from a tied model)."""
    if name not in saved and TIED.get(name) in saved:
        return TIED[name]
    return name


@contextlib.contextmanager
def open_shard(folder: Path, file: str):
    """safetensors' safe_open on a checkpoint's file; UserError naming a missing or damaged one."""
    from safetensors import safe_open

    try:
        with safe_open(str(folder / file), framework="pt") as f:
            yield f
    except FileNotFoundError:
        raise UserError(f"checkpoint {folder}: {file} is missing (a rank's file; copy the whole checkpoint "
                        "folder)") from None
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 (safetensors' own errors for a truncated or damaged file)
        raise UserError(f"checkpoint {folder}: {file} is truncated or damaged ({e}); load the checkpoint before "
                        "it") from None


def foreign_format(path: Path) -> str:
    """Why a folder that is not ours cannot be loaded, and the way through, or ''."""
    if not path.is_dir():
        return ""
    latest = path / "latest_checkpointed_iteration.txt"  # a Megatron-LM save root
    inner = [path] + sorted(p for p in path.glob("iter_*") if p.is_dir())[-1:]
    if latest.is_file() or any((p / ".metadata").is_file() or any(p.glob("*.distcp")) or any(p.glob("mp_rank_*"))
                               for p in inner):
        return ("; it is a Megatron-LM (torch_dist / legacy) or PyTorch DCP checkpoint, whose metadata is pickled, "
                "and fivefold never unpickles files: convert it to a Hugging Face folder (Megatron-Bridge's "
                "export, or Megatron's checkpoint converter) and start from it with --load-hf DIR")
    pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
    if pickled:
        return (f"; it holds {', '.join(pickled[:3])}, pickles (they can run code when loaded): re-save as "
                "safetensors, e.g. a Hugging Face folder with save_pretrained(..., safe_serialization=True), "
                "and start from it with --load-hf DIR")
    if (path / "config.json").is_file():
        return "; it looks like a Hugging Face folder: start from it with --load-hf DIR"
    return ""
