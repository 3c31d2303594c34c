"""The step's loss, shared by the one-process and the pipeline passes: this CP rank's tokens,
the summed token losses of a microbatch, and the per-token mean over the global batch.

Each microbatch backpropagates sum(token losses) / N_global (N_global = target tokens of the global
batch on all ranks); the gradients summed over DP then are the global per-token mean loss's, and the
reported loss is the sum of the loss sums over the ranks / N_global.
"""
from __future__ import annotations

import torch
from torch import nn

from fivefold.data.loader import IGNORE_INDEX, Microbatch
from fivefold.model.dropout import DropoutKey
from fivefold.parallel.context.context_parallel import split_tokens
from fivefold.runtime import comm
from fivefold.runtime.mesh import Group


def cp_tokens(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This context-parallel rank's (b, s/cp) share of a microbatch's ids and labels (the model's
    CP split, fivefold.parallel.context.context_parallel); the whole (b, s) without CP."""
    cp = getattr(model, "cp", None)
    return (ids, labels) if cp is None else split_tokens(ids, labels, cp, model.sequence_multiple)


def dropout_kwargs(step: int | None, mb: Microbatch) -> dict:
    """{"noise": DropoutKey} for a training forward of `mb` at `step` (fivefold.model.dropout), or {}
    when the batch does not say where it came from (the model then applies no dropout)."""
    if step is None or mb.sample_ids is None:
        return {}
    return {"noise": DropoutKey(step, mb.sample_ids)}


def loss_sum(model: nn.Module, mb: Microbatch, device: torch.device, step: int | None = None) -> torch.Tensor:
    """Sum of next-token cross-entropies over the microbatch's target tokens (fp32): Decoder.loss.
    Under CP over this rank's s/cp tokens: the sums over DP x CP add up to the global batch's.
    `step` (training): dropout, if the model has any, keyed by it and the micro-batch's samples."""
    ids, labels = cp_tokens(model, mb.input_ids, mb.labels)
    total, _ = model.loss(ids.to(device), labels.to(device), ignore_index=IGNORE_INDEX, docs=mb.docs,
                          **dropout_kwargs(step, mb))
    return total


def global_mean(local_sum: torch.Tensor, tokens: int, *groups: Group) -> float:
    """Per-token mean loss: this rank's float64 loss sum, added over each of `groups` in turn
    (DP x CP; with PP first the pipeline group, where only the last stage's rank holds a sum), over
    `tokens`, the target tokens of those batches on all ranks."""
    for group in groups:
        comm.all_reduce_(local_sum, group, tag="loss")
    return float(local_sum / tokens)
