"""The optimizer math every data-parallel mode shares: AdamW's two parameter groups, and clipping by
the global gradient norm.

Global norm: ||g|| = sqrt( sum over every parameter shard owned by any rank of sum(g^2) ). Each rank
sums the squares of the shards it owns (replicated parameters counted once, by the rank that owns
them: ParamMeta.owns_grad), and the partial sums are added over the model-parallel group; DP
replicas hold identical reduced gradients, so the DP group is not summed over (with the distributed
optimizer each DP rank holds one chunk of them, and it is). If ||g|| > max_norm, every gradient is
scaled by max_norm / (||g|| + 1e-6), as torch.nn.utils.clip_grad_norm_ does.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fivefold.config.schema import TrainingConfig
from fivefold.runtime import comm
from fivefold.runtime.mesh import Group


@dataclass(frozen=True)
class OptimShard:
    """A tensor the optimizer keeps state for: [lo, hi) of parameter `name` flattened."""

    name: str
    key: torch.Tensor
    """The tensor optimizer.state is keyed by."""
    flat: tuple[int, int]


def whole_shards(model: nn.Module) -> list[OptimShard]:
    """The plain optimizer's: each parameter whole."""
    return [OptimShard(n, p, (0, p.numel())) for n, p in model.named_parameters()]


def build_optimizer(model: nn.Module, training: TrainingConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on parameters with >= 2 dims (not on norms' gains or biases), as Megatron."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return build_adamw(decay, no_decay, training)


def build_adamw(decay: list[torch.Tensor], no_decay: list[torch.Tensor], training: TrainingConfig) -> torch.optim.Optimizer:
    """AdamW over two groups: `decay` with training.weight_decay, `no_decay` without. The update is
    elementwise either way, so a tensor stepped in pieces gets the same numbers as stepped whole. On the
    GPU torch's fused kernel, as Megatron's fused Adam (stepped a tensor at a time, ~12 launches each,
    AdamW took ~230 ms of an MoE step with 1,426 tensors on an H100); elsewhere a tensor at a time
    (foreach=False: the CPU's numbers as they were)."""
    groups = [{"params": decay, "weight_decay": training.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    on_gpu = bool(decay + no_decay) and all(t.is_cuda for t in decay + no_decay)
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=training.lr,
                             betas=(training.adam_beta1, training.adam_beta2), eps=training.adam_eps,
                             **({"fused": True} if on_gpu else {"foreach": False}))


def by_device(tensors: Iterable[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    """`tensors` by device, in order (a multi-tensor call takes one device's)."""
    out: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float, group: Group | Sequence[Group], *,
                   counted: Callable[[nn.Parameter], bool] | None = None) -> float:
    """Scale the gradients of `params` to global norm <= max_norm (0 = measure only); returns the
    norm before clipping. `counted(p)` says whether this rank counts p in the norm (default: every
    p; a replicated parameter is counted by one rank only, but scaled on all of them). The squares
    are added over each group of `group` in turn (the distributed optimizer adds its DP x CP group,
    whose ranks hold disjoint chunks)."""
    params = [p for p in params if p.grad is not None]
    # Summed in fp64 where the gradients live and copied to the host once. On a GPU in one multi-tensor
    # call (a few kernels per parameter made the step launch-bound); elsewhere a tensor at a time (the
    # multi-tensor norm held fp64 copies of the gradients on the CPU).
    sq = torch.zeros((), dtype=torch.float64)
    for device, mine in by_device(p.grad for p in params if counted is None or counted(p)).items():
        if device.type == "cuda":  # (optimizer offload: the host's share is summed apart)
            sq += torch.stack(torch._foreach_norm(mine, 2, dtype=torch.float64)).square().sum().cpu()
        else:
            sq += sum((g.double().pow(2).sum() for g in mine), torch.zeros((), dtype=torch.float64))
    for g in [group] if isinstance(group, Group) else group:
        comm.all_reduce_(sq, g, tag="grad-norm")
    norm = float(sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        torch._foreach_mul_([p.grad for p in params], max_norm / (norm + 1e-6))
    return norm
