"""Expert capacity and token dropping (Megatron-Core's apply_router_token_dropping).

One router call sees n tokens (a rank's tokens of one micro-batch) and makes n k assignments. With a
capacity factor c each expert takes at most

    capacity = ceil(n k / E * c)

of them; when capacity >= n nothing can overflow. An over-full expert keeps, by `policy`:
  probs     the assignments with the highest routing weights (ties: the earlier token);
  position  the earliest tokens, in Megatron's [s, b] token order: sequence position first, then
            the sequence in the micro-batch.
A dropped assignment contributes nothing (its token keeps its other experts and the residual) and
gives its router weight no gradient. The aux losses are computed from the routing before dropping,
as Megatron's.

Which tokens compete decides which layouts can equal one process: the competition is per router
call, so DP, PP and EP (EP ranks are data ranks: each routes its own micro-batch) keep the
one-process competition; TP (with or without SP) and CP give each rank a part of a micro-batch's
tokens, each with its own capacity, as Megatron does (docs/moe.md).
"""
from __future__ import annotations

import torch

from fivefold.capacity import expert_capacity
from fivefold.ops.counting import bincount


def within_capacity(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, factor: float,
                    policy: str, batch: int) -> torch.Tensor:
    """(n, k) bool: the assignments kept. `experts`, `weights` (n, k) are one router call's top-k for
    its n tokens, flattened from (batch, n / batch) (our [b, s] order)."""
    n, k = experts.shape
    capacity = expert_capacity(n, k, num_experts, factor)
    if capacity >= n:
        return torch.ones_like(experts, dtype=torch.bool)
    flat = experts.reshape(-1)  # assignment a = token * k + j
    token = torch.arange(n * k, device=experts.device) // k
    if policy == "probs":
        first = torch.sort(weights.reshape(-1).detach(), descending=True, stable=True).indices
    elif policy == "position":
        s = n // batch
        first = torch.argsort((token % s) * batch + token // s, stable=True)  # [s, b] order
    else:
        raise ValueError(f"moe_token_drop_policy={policy!r}: probs or position")
    order = first[torch.argsort(flat[first], stable=True)]  # by expert, then by priority
    counts = bincount(flat, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.empty_like(flat)
    rank_in_expert[order] = torch.arange(n * k, device=flat.device) - starts[flat[order]]
    return (rank_in_expert < capacity).view(n, k)
