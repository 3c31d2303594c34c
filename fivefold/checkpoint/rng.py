"""The RNG states a checkpoint holds: one file per rank, rng-RRRRR.safetensors (torch's CPU generator,
and CUDA's when it is in use), read back only by a run of the same world size, so that a resumed run
draws the dropout masks and data order the uninterrupted one would have."""
from __future__ import annotations

from pathlib import Path

import torch

from fivefold.checkpoint.checksum import expected, verify_file
from fivefold.checkpoint.layout import open_shard
from fivefold.errors import UserError


def rng_file(rank: int) -> str:
    """The file of a checkpoint holding rank `rank`'s RNG state."""
    return f"rng-{rank:05d}.safetensors"


def rng_state() -> dict[str, torch.Tensor]:
    state = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def has_rng(meta: dict, world_size: int) -> bool:
    """Whether a checkpoint holds RNG states for a run of `world_size` ranks: saved at that world size,
    and not converted from another one (`convert` copies no streams then and says so: `rng_saved`)."""
    return meta.get("world_size") == world_size and meta.get("rng_saved", True)


def rng_missing(folder: Path, ranks: list[int]) -> UserError:
    named = ", ".join(rng_file(r) for r in ranks[:3]) + (f" and {len(ranks) - 3} more" if len(ranks) > 3 else "")
    whose = f"rank {ranks[0]}'s RNG state" if len(ranks) == 1 else "the ranks' RNG states"
    return UserError(f"checkpoint {folder}: {named} {'is' if len(ranks) == 1 else 'are'} missing ({whose}; copy the "
                     "whole checkpoint folder, or give --no-load-rng, checkpoint.load_rng=false, to start fresh RNG "
                     "streams)")


def check_rng_files(folder: Path, meta: dict, world_size: int) -> None:
    """UserError naming the ranks whose RNG file checkpoint `folder` lacks (when it holds RNG states for
    `world_size` ranks)."""
    if not has_rng(meta, world_size):
        return
    missing = [r for r in range(world_size) if not (folder / rng_file(r)).is_file()]
    if missing:
        raise rng_missing(folder, missing)


def load_rng_state(folder: Path, meta: dict, rank: int, world_size: int) -> None:
    """Set this process's generators from rank `rank`'s file (verified against its checksum), when the
    checkpoint holds RNG states for `world_size` ranks; a missing file is refused, as a missing shard:
    never a run that silently starts other RNG streams."""
    if not has_rng(meta, world_size):
        return
    path = folder / rng_file(rank)
    if not path.is_file():
        raise rng_missing(folder, [rank])
    if path in expected(folder, meta):
        verify_file(path, expected(folder, meta)[path])
    with open_shard(folder, rng_file(rank)) as f:
        torch.set_rng_state(f.get_tensor("torch_cpu"))
        if "torch_cuda" in f.keys() and torch.cuda.is_available():
            torch.cuda.set_rng_state(f.get_tensor("torch_cuda"))
