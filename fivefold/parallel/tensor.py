"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) with its sequence-parallel mode
(Korthikanti et al. 2022), over an explicitly passed TP `Group`.

Column-parallel  Y = X A^T, A (out, in) split by output rows: rank r holds A_r and computes
  Y_r = X A_r^T (its slice of the output features). Forward needs the whole X on every rank:
    TPMode.ALL_REDUCE:        X is replicated; f = identity forward, all-reduce of dL/dX backward.
    TPMode.SEQUENCE_PARALLEL: X arrives as the rank's s/tp shard; all-gather along the sequence
                              forward, reduce-scatter of dL/dX backward.
Row-parallel     Y = X B^T, B (out, in) split by input columns: rank r holds B_r and X_r (the output
  of a column-parallel layer) and computes the partial sum P_r = X_r B_r^T; Y = sum_r P_r:
    TPMode.ALL_REDUCE:        g = all-reduce forward, identity backward.
    TPMode.SEQUENCE_PARALLEL: reduce-scatter along the sequence forward (Y leaves as the s/tp
                              shard), all-gather of dL/dY backward.
A transformer block is norm -> column (qkv / gate+up) -> local math -> row (out / down) -> residual,
so each block holds its activations outside the linears either replicated (ALL_REDUCE) or
sequence-sharded (SEQUENCE_PARALLEL), with no communication between row and the next column.

Sequence parallel saves memory only if the gathered input is not kept for backward: the column
layer saves its s/tp shard and re-gathers it in backward for dL/dA = dL/dY^T X. Backward launches
that re-gather first, computes dL/dX = dL/dY A meanwhile, then launches dL/dX's reduce-scatter
(all-reduce without SP) and computes dL/dA while it is in flight (Megatron's async grad all-reduce).

Parameters carry attributes other code reads (Megatron's `tensor_model_parallel`):
  tp_split_dim   0 or 1: the parameter is this rank's slice of the full one along that dim.
  tp_sum_grad    True: replicated, but each rank's gradient covers only its sequence shard (norms
                 under SP): the gradients are summed over TP after backward (`reduce_tp_grads`).
  tp_kv_slot     (slot, slots): a replicated KV-head weight (TP > KV heads); gradients are summed
                 over the ranks holding the same slot.
"""
from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.parallel.heads import HeadSplit
from fivefold.runtime import comm, traffic
from fivefold.runtime.mesh import Group

SEQ_DIM = 1
"""Activations are (b, s, h): the sequence is dim 1."""


class TPMode(enum.Enum):
    """How activations outside the TP linears are held on the ranks of a TP group."""

    ALL_REDUCE = "all-reduce"
    """Replicated (b, s, h) on every TP rank; the linears all-reduce."""
    SEQUENCE_PARALLEL = "sequence-parallel"
    """Sharded (b, s/tp, h) along the sequence; the linears all-gather and reduce-scatter."""

    @classmethod
    def of(cls, sequence_parallel: bool) -> "TPMode":
        return cls.SEQUENCE_PARALLEL if sequence_parallel else cls.ALL_REDUCE


def _mark(tag: str, phase: str) -> None:
    """A compute span in comm's event log, so tests can see what overlapped a collective."""
    traffic.event("compute", tag, phase)


class _ColumnParallel(torch.autograd.Function):
    """Y_j = X A_j^T for one input X and the weights A_j of this rank (q, k, v or gate, up): one
    communication for all of them. Under SP, X is (b, s/tp, h) and only that shard is saved."""

    @staticmethod
    def forward(ctx, x, group: Group, mode: TPMode, *weights):
        sp = mode is TPMode.SEQUENCE_PARALLEL and group.size > 1
        x_full = comm.all_gather(x, SEQ_DIM, group, "sp") if sp else x  # (b, s, h)
        ctx.save_for_backward(x, *weights)
        ctx.group, ctx.sp = group, sp
        return tuple(F.linear(x_full, w) for w in weights)  # each (b, s, out_j/tp)

    @staticmethod
    def backward(ctx, *grad_ys):
        x, *weights = ctx.saved_tensors
        group, sp = ctx.group, ctx.sp
        gathered = comm.all_gather(x, SEQ_DIM, group, "sp", async_op=True) if sp else None
        grad_x = None
        work = None
        if ctx.needs_input_grad[0]:
            grad_x = sum(g @ w for g, w in zip(grad_ys, weights))  # (b, s, h), partial over TP
        if sp:
            x_full, gather_work = gathered
            gather_work.wait()
        else:
            x_full = x
        if grad_x is not None and group.size > 1:
            if sp:
                grad_x, work = comm.reduce_scatter(grad_x, SEQ_DIM, group, "sp", async_op=True)  # (b, s/tp, h)
            else:
                work = comm.all_reduce_async(grad_x, group, "tp")
        _mark("tp-weight-grad", "start")
        x2 = x_full.reshape(-1, x_full.shape[-1])  # (b*s, h)
        grad_ws = [g.reshape(-1, g.shape[-1]).t() @ x2 for g in grad_ys]  # each (out_j/tp, h)
        _mark("tp-weight-grad", "end")
        if work is not None:
            work.wait()
        return (grad_x, None, None, *grad_ws)


def column_parallel(x: torch.Tensor, weights: Sequence[torch.Tensor], group: Group,
                    mode: TPMode) -> tuple[torch.Tensor, ...]:
    """(b, s or s/tp, in) -> one (b, s, out_j/tp) per weight; see the module docstring."""
    return _ColumnParallel.apply(x, group, mode, *weights)


def row_parallel(x: torch.Tensor, weight: torch.Tensor, group: Group, mode: TPMode) -> torch.Tensor:
    """(b, s, in/tp) -> (b, s, out) [ALL_REDUCE] or (b, s/tp, out) [SEQUENCE_PARALLEL]."""
    partial = F.linear(x, weight)  # (b, s, out), this rank's term of the sum over TP
    if mode is TPMode.SEQUENCE_PARALLEL:
        return comm.reduce_scatter(partial, SEQ_DIM, group, "sp")  # (b, s/tp, out)
    return comm.reduce_from(partial, group, "tp")


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A (out, in) and b split by output rows over `group`; Y stays split
    (b, s, out/tp). `partitions` names a fused weight's parts (e.g. [gate, up]): each part is split
    on its own, so rank r holds [gate_r; up_r] and the two halves of its output stay aligned."""

    def __init__(self, in_features: int, out_features: int, *, group: Group, mode: TPMode = TPMode.ALL_REDUCE,
                 bias: bool = False, partitions: Sequence[int] | None = None, dtype=None, device=None):
        super().__init__()
        parts = list(partitions or [out_features])
        if sum(parts) != out_features or any(p % group.size for p in parts):
            raise ValueError(f"output parts {parts} must sum to {out_features} and each divide over TP={group.size}")
        self.group, self.mode, self.partitions = group, mode, parts
        self.weight = nn.Parameter(torch.empty(out_features // group.size, in_features, dtype=dtype, device=device))
        self.weight.tp_split_dim = 0
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features // group.size, dtype=dtype, device=device))
            self.bias.tp_split_dim = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (y,) = column_parallel(x, [self.weight], self.group, self.mode)  # (b, s, out/tp)
        return y if self.bias is None else y + self.bias

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's shard of the full (out, in) weight (and bias)."""
        self.weight.copy_(shard(weight, 0, self.group.rank, self.group.size, self.partitions))
        if bias is not None:
            self.bias.copy_(shard(bias, 0, self.group.rank, self.group.size, self.partitions))


class RowParallelLinear(nn.Module):
    """Y = X B^T + b with B (out, in) split by input columns over `group`: X arrives split
    (b, s, in/tp), Y leaves whole (ALL_REDUCE) or sequence-sharded (SEQUENCE_PARALLEL). The bias is
    replicated and added after the reduction (under SP its gradient is summed over TP)."""

    def __init__(self, in_features: int, out_features: int, *, group: Group, mode: TPMode = TPMode.ALL_REDUCE,
                 bias: bool = False, dtype=None, device=None):
        super().__init__()
        if in_features % group.size:
            raise ValueError(f"in_features={in_features} must divide over TP={group.size}")
        self.group, self.mode = group, mode
        self.weight = nn.Parameter(torch.empty(out_features, in_features // group.size, dtype=dtype, device=device))
        self.weight.tp_split_dim = 1
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
            self.bias.tp_sum_grad = mode is TPMode.SEQUENCE_PARALLEL

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = row_parallel(x, self.weight, self.group, self.mode)
        return y if self.bias is None else y + self.bias

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight.copy_(shard(weight, 1, self.group.rank, self.group.size))
        if bias is not None:
            self.bias.copy_(bias)


class VocabParallelEmbedding(nn.Module):
    """E[ids] with the (V_padded, h) table split by rows: rank r holds rows [r V/tp, (r+1) V/tp).
    Each rank looks up the ids in its range (zeros elsewhere) and the partial rows are summed:
    all-reduce (ALL_REDUCE) or reduce-scatter along the sequence (SEQUENCE_PARALLEL, output
    (b, s/tp, h)). V_padded = vocab rounded up to a multiple of 128 x TP; padded rows are never
    looked up (ids < vocab) and the output layer's padded logits are masked in the loss."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: Group, mode: TPMode = TPMode.ALL_REDUCE,
                 dtype=None, device=None):
        super().__init__()
        if num_embeddings % group.size:
            raise ValueError(f"padded vocabulary {num_embeddings} must divide over TP={group.size}")
        self.group, self.mode = group, mode
        self.rows = num_embeddings // group.size
        self.start = group.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, embedding_dim, dtype=dtype, device=device))
        self.weight.tp_split_dim = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        partial = F.embedding(local.masked_fill(outside, 0), self.weight)  # (b, s, h)
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.mode is TPMode.SEQUENCE_PARALLEL:
            return comm.reduce_scatter(partial, SEQ_DIM, self.group, "sp")  # (b, s/tp, h)
        return comm.reduce_from(partial, self.group, "tp")

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        self.weight.copy_(shard(weight, 0, self.group.rank, self.group.size))


def shard(full: torch.Tensor, dim: int, rank: int, size: int, partitions: Sequence[int] | None = None) -> torch.Tensor:
    """Rank `rank`'s slice of `full` along `dim` split `size` ways; with `partitions` (sizes of the
    fused parts along dim), each part is split on its own and the rank's slices concatenated."""
    parts = full.split(list(partitions), dim) if partitions else (full,)
    pieces = []
    for p in parts:
        if p.shape[dim] % size:
            raise ValueError(f"size {p.shape[dim]} along dim {dim} does not divide over {size} ranks")
        pieces.append(p.chunk(size, dim)[rank])
    return torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0].clone()


def shard_heads(full: torch.Tensor, heads: range, head_dim: int) -> torch.Tensor:
    """Rows of a (n_heads * head_dim, in) projection for the given heads (contiguous range)."""
    return full[heads.start * head_dim: heads.stop * head_dim].clone()


def mark_kv_replica(param: nn.Parameter, split: HeadSplit, kv_heads: int) -> None:
    """`param` is a whole KV head held by `split.kv_replicas` TP ranks (TP > KV heads)."""
    param.tp_kv_slot = (split.kv_heads.start, kv_heads)
    param.tp_kv_replicas = split.kv_replicas


def mark_sequence_sharded(param: nn.Parameter) -> None:
    """`param` is replicated but sees only this rank's sequence shard (norm gains under SP)."""
    param.tp_sum_grad = True


@torch.no_grad()
def reduce_tp_grads(params: Iterable[nn.Parameter], group: Group) -> None:
    """Complete the gradients of replicated parameters after backward (sums commute with the DP
    sum, so before or after it). Sequence-sharded ones (`tp_sum_grad`): one flat all-reduce over TP.
    KV replicas (`tp_kv_slot`): each rank writes its gradient into its slot of a zero buffer of all
    slots; the all-reduce over TP then sums, per slot, exactly the replicas of that KV head."""
    if group.size == 1:
        return
    summed = [p for p in params if p.grad is not None and getattr(p, "tp_sum_grad", False)]
    kv = [p for p in params if p.grad is not None and hasattr(p, "tp_kv_slot")]
    if summed:
        flat = torch.cat([p.grad.reshape(-1) for p in summed])
        comm.all_reduce_(flat, group, "tp-grad")
        for p, g in zip(summed, flat.split([p.numel() for p in summed])):
            p.grad.copy_(g.view_as(p.grad))
    for p in kv:
        slot, slots = p.tp_kv_slot
        buf = p.grad.new_zeros(slots, *p.grad.shape)
        buf[slot] = p.grad
        comm.all_reduce_(buf, group, "tp-grad")
        p.grad.copy_(buf[slot])


def owns_grad(param: nn.Parameter, tp_rank: int) -> bool:
    """Whether this TP rank counts `param` in the global gradient norm: split parameters on every
    rank (each a distinct slice), a KV replica on the first rank of its replicas, any other
    replicated parameter on TP rank 0 only."""
    if hasattr(param, "tp_split_dim"):
        return True
    if hasattr(param, "tp_kv_slot"):
        return tp_rank % param.tp_kv_replicas == 0
    return tp_rank == 0
