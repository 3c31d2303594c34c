"""One optimizer step on one rank: microbatches forward/backward, gradient sync, clip, AdamW.

The step's loss is the per-token mean over the global batch: each microbatch backpropagates
sum(token losses) / N_global (N_global = target tokens of the global batch on all ranks), the DP
reducer sums gradients over the DP group, and the reported loss is the DP-sum of the loss sums / N_global.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from fivefold.data.loader import IGNORE_INDEX, Microbatch, StepBatch
from fivefold.runtime import comm
from fivefold.runtime.mesh import Group
from fivefold.parallel.context import split_tokens
from fivefold.parallel.data import GradReducer
from fivefold.parallel.distributed_optimizer import DistributedOptimizer
from fivefold.parallel.expert_grads import finish_moe_grads
from fivefold.model.moe import aux_loss_term
from fivefold.parallel.param_meta import ParamMeta, metas_of
from fivefold.parallel.tensor import reduce_tp_grads
from fivefold.train.optim import clip_grad_norm


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    tokens: int
    aux_loss: float | None = None
    """MoE: the step's load-balancing + z loss (mean over micro-batches, summed over layers); not in `loss`."""


def autocast(precision: str, device: torch.device):
    """bf16: matmuls in bf16 under autocast, fp32 master weights, gradients and optimizer state."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def cp_tokens(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This context-parallel rank's (b, s/cp) share of a microbatch's ids and labels (the model's
    CP split, fivefold.parallel.context); the whole (b, s) without CP."""
    cp = getattr(model, "cp", None)
    return (ids, labels) if cp is None else split_tokens(ids, labels, cp, model.sequence_multiple)


def loss_sum(model: nn.Module, mb: Microbatch, precision: str, device: torch.device) -> torch.Tensor:
    """Sum of next-token cross-entropies over the microbatch's target tokens (fp32): Decoder.loss.
    Under CP over this rank's s/cp tokens: the sums over DP x CP add up to the global batch's."""
    ids, labels = cp_tokens(model, mb.input_ids, mb.labels)
    with autocast(precision, device):
        total, _ = model.loss(ids.to(device), labels.to(device), ignore_index=IGNORE_INDEX)
    return total


def set_lr(optimizer: torch.optim.Optimizer | DistributedOptimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr


def global_mean(local_sum: torch.Tensor, tokens: int, *groups: Group) -> float:
    """Per-token mean loss: this rank's float64 loss sum, added over each of `groups` in turn
    (DP x CP; with PP first the pipeline group, where only the last stage's rank holds a sum), over
    `tokens`, the target tokens of those batches on all ranks."""
    for group in groups:
        comm.all_reduce_(local_sum, group, tag="loss")
    return float(local_sum / tokens)


def finish_grads(params: list[nn.Parameter], clip_grad: float, model_parallel_group: Group,
                 tp_group: Group | None, *, metas: dict[int, ParamMeta], not_counted: Iterable[nn.Parameter] = (),
                 optimizer: torch.optim.Optimizer | DistributedOptimizer | None = None,
                 expert_groups: tuple[Group, Group] | None = None) -> float:
    """After the DP reduction: complete the gradients of TP-replicated parameters (SP norm gains, KV
    replicas: `reduce_tp_grads`), then clip all of `params` by the global norm summed over
    `model_parallel_group` (TP x PP), each parameter counted once: split ones on every TP rank,
    replicated ones on their owning TP rank (`owns_grad`), none of `not_counted` (a second copy of a
    tied weight, counted where its first copy lives). Returns the norm before clipping.
    With the distributed optimizer all of this runs on its DP chunks of `params` (Megatron's main
    params, which carry their parameter's TP attributes), and the squares are also added over its
    DP x CP group, whose ranks hold disjoint chunks.
    A MoE model's routed experts (`expert_groups` = (ETP x EP group, PP group)) are counted over
    their own groups: fivefold.parallel.expert_grads.finish_moe_grads."""
    if expert_groups is not None and any(metas[id(p)].is_expert for p in params):
        return finish_moe_grads(params, clip_grad, metas=metas, tp=tp_group, expert_mp=expert_groups[0],
                                pp=expert_groups[1], not_counted=not_counted, optimizer=optimizer)
    groups = [model_parallel_group]
    if isinstance(optimizer, DistributedOptimizer):
        not_counted = optimizer.main_params(not_counted)
        params = optimizer.main_params(params)
        groups = [optimizer.group, model_parallel_group]
        metas = {**metas, **optimizer.metas}
    if tp_group is not None:
        reduce_tp_grads([(p, metas[id(p)]) for p in params], tp_group)
    tp_rank = tp_group.rank if tp_group is not None else 0
    skip = {id(p) for p in not_counted}
    return clip_grad_norm(params, clip_grad, groups,
                          counted=lambda p: id(p) not in skip and metas[id(p)].owns_grad(tp_rank))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, reducer: GradReducer, batch: StepBatch, *,
               lr: float, clip_grad: float, precision: str, dp_group: Group, model_parallel_group: Group,
               device: torch.device, tp_group: Group | None = None,
               expert_groups: tuple[Group, Group] | None = None) -> StepResult:
    """`tp_group`: completes the gradients of TP-replicated parameters (SP norms, KV replicas) and
    counts each replicated parameter once in the gradient norm (summed over `model_parallel_group`).
    `expert_groups`: (ETP x EP, PP) groups, for a MoE model's routed experts (see finish_grads)."""
    set_lr(optimizer, lr)
    reducer.zero_grad()
    local = torch.zeros((), dtype=torch.float64, device=device)  # on the device: no host sync per microbatch
    moe = getattr(getattr(model, "cfg", None), "is_moe", False)
    aux = torch.zeros((), dtype=torch.float64, device=device) if moe else None
    n = len(batch.microbatches)
    for i, mb in enumerate(batch.microbatches):
        reducer.prepare(last=i == n - 1)
        s = loss_sum(model, mb, precision, device)
        term = aux_loss_term(model) if aux is not None else None  # read before backward (recompute reruns forward)
        if term is not None:
            aux += term
        (s / batch.global_tokens).backward()
        local += s.detach().double()
    if n == 0:
        reducer.prepare(last=True)
    reducer.finish()
    norm = finish_grads(list(model.parameters()), clip_grad, model_parallel_group, tp_group, metas=metas_of(model),
                        optimizer=optimizer, expert_groups=expert_groups)
    optimizer.step()
    aux_loss = global_mean(aux.cpu(), 1, dp_group, model_parallel_group) if aux is not None else None  # every rank
    return StepResult(global_mean(local.cpu(), batch.global_tokens, dp_group), norm, batch.global_tokens, aux_loss)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[StepBatch], *, precision: str, dp_group: Group,
             device: torch.device) -> float:
    """Per-token mean loss over the given eval batches (all DP ranks)."""
    local = torch.zeros((), dtype=torch.float64)
    for batch in batches:
        for mb in batch.microbatches:
            local += float(loss_sum(model, mb, precision, device))
    return global_mean(local, sum(b.global_tokens for b in batches), dp_group)
