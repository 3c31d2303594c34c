"""Stop a run at its first non-finite loss or gradient norm (Megatron's --check-for-nan-in-loss-and-grad).

A step's loss and gradient norm are the same numbers on every rank (the loss is reduced over DP x CP
and PP, the squared norm over TP x PP, and DP too under ZeRO; NaN and inf survive every sum), so all
ranks decide alike at the same step with no extra communication. Only then, on the way out, one
all-gather tells every rank which rank holds the first parameter (in `named_parameters` order) whose
gradient is non-finite, so each rank's message is the same and names it. The loop raises before the
step's checkpoint is written: the last checkpoint on disk is the last good one.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from fivefold.runtime import comm
from fivefold.runtime.mesh import Group

NAME_BYTES = 256
"""A parameter name as gathered (UTF-8, zero-padded; longer names are cut)."""


class NonFiniteError(RuntimeError):
    """A run stopped on purpose at a non-finite loss or gradient norm; the message says where and what next."""


def is_finite(x: float | None) -> bool:
    return x is None or math.isfinite(x)


def first_nonfinite_grad(model: nn.Module) -> str | None:
    """The first parameter of `model` whose .grad holds a NaN or inf (None: none does, or the
    gradients live elsewhere, e.g. in the distributed optimizer's buffers)."""
    for name, p in model.named_parameters():
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            return name
    return None


def _first_over_ranks(name: str | None, group: Group) -> tuple[int, str] | None:
    """(rank, name) of the lowest rank of `group` that found a parameter (collective over `group`)."""
    mine = torch.zeros(1, NAME_BYTES, dtype=torch.uint8)
    if name:
        raw = name.encode()[:NAME_BYTES]
        mine[0, : len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    every = comm.all_gather(mine, 0, group, tag="nan-check")  # (world, NAME_BYTES)
    for r in range(every.shape[0]):
        if every[r, 0]:
            return group.ranks[r], bytes(every[r].tolist()).rstrip(b"\0").decode(errors="replace")
    return None


def nonfinite_error(step: int, loss: float, grad_norm: float, model: nn.Module, world: Group,
                    last_checkpoint: str | Path | None) -> NonFiniteError:
    """The error for step `step` (called on every rank: gathers over `world`)."""
    what = " and ".join(f"the {k} is {v}" for k, v in (("loss", loss), ("gradient norm", grad_norm))
                        if not is_finite(v))
    found = _first_over_ranks(first_nonfinite_grad(model), world)
    where = f"; first non-finite gradient: rank {found[0]}, parameter {found[1]}" if found else ""
    last = f"the last checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was written"
    return NonFiniteError(
        f"step {step}: {what}{where}. The run was stopped before this step's checkpoint; {last} (resume "
        "with --load and a lower training.lr, a warm-up, or training.clip_grad > 0; "
        "--no-check-for-nan-in-loss-and-grad / training.check_for_nan_in_loss_and_grad=false trains on)")
