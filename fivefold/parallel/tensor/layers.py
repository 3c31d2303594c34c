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

Each parameter is created with its metadata (fivefold.parallel.param_meta.ParamMeta): `shard`, the
slice of the one-process parameter it is; `tp_grad_sum`, replicated but seeing only this rank's
sequence shard (norms under SP: gradients summed over TP after backward, `reduce_tp_grads`);
`kv_replica`, a KV head replicated over TP ranks (TP > KV heads; summed over the ranks of its slot).
"""
from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.parallel.tensor.heads import HeadSplit
from fivefold.parallel.param_meta import KVReplica, ParamMeta, Shard, mark_all, named_metas, new_param, set_meta
from fivefold.runtime import comm, traffic
from fivefold.runtime.backward_pass import input_grad_wanted, weight_grads_wanted
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
        dtype = grad_ys[0].dtype  # under autocast the forward ran in bf16: backward matmuls too
        weights = [w.to(dtype) for w in weights]
        # only what this pass uses: a zero-bubble schedule's B wants dX alone, its W the weights'
        # gradients alone (fivefold.runtime.backward_pass), each without the other's matmuls and call
        want_x, want_w = input_grad_wanted(ctx, 0), weight_grads_wanted()
        gathered = comm.all_gather(x, SEQ_DIM, group, "sp", async_op=True) if sp and want_w else None
        grad_x = None
        work = None
        if want_x:
            grad_x = sum(g @ w for g, w in zip(grad_ys, weights))  # (b, s, h), partial over TP
        if grad_x is not None and group.size > 1:
            if sp:
                grad_x, work = comm.reduce_scatter(grad_x, SEQ_DIM, group, "sp", async_op=True)  # (b, s/tp, h)
            else:
                work = comm.all_reduce_async(grad_x, group, "tp")
        grad_ws = [None] * len(weights)
        if want_w:
            if sp:
                x_full, gather_work = gathered
                gather_work.wait()
            else:
                x_full = x
            _mark("tp-weight-grad", "start")
            x2 = x_full.reshape(-1, x_full.shape[-1]).to(dtype)  # (b*s, h)
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


def even(size: int, group: Group) -> range:
    """This rank's range of `size` split evenly over the group."""
    if size % group.size:
        raise ValueError(f"size {size} does not divide over TP={group.size}")
    n = size // group.size
    return range(group.rank * n, (group.rank + 1) * n)


def _weight(module: nn.Module, group: Group, full_shape: tuple[int, ...], dim: int, part: range, dtype,
            device) -> nn.Parameter:
    """module.weight: rows / columns `part` (along `dim`) of the one-process (full_shape) weight."""
    shape = list(full_shape)
    shape[dim] = len(part)
    return new_param(module, "weight", tuple(shape), dtype=dtype, device=device,
                     shard=Shard(tuple(full_shape), dim, part.start, len(part), group.name))


class ColumnParallelLinear(nn.Module):
    """Y = X A^T (+ b) with A (out, in) split by output rows over `group`: this rank holds rows `rows`
    (default its even share; attention passes its heads' rows), b's same entries, and returns Y
    split (b, s, out/tp). Several column layers reading the same input share one communication via
    `column_linears`."""

    def __init__(self, in_features: int, out_features: int, *, group: Group, mode: TPMode = TPMode.ALL_REDUCE,
                 rows: range | None = None, bias: bool = False, dtype=None, device=None):
        super().__init__()
        self.group, self.mode = group, mode
        rows = rows or even(out_features, group)
        self.weight = _weight(self, group, (out_features, in_features), 0, rows, dtype, device)
        self.bias = new_param(self, "bias", (len(rows),), dtype=dtype, device=device,
                              shard=Shard((out_features,), 0, rows.start, len(rows), group.name)) if bias else None
        """The bias rows of this rank's output rows (Megatron's column-parallel bias: sharded, added locally)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_linears(x, [self])[0]  # (b, s, out/tp)


class RowParallelLinear(nn.Module):
    """Y = X B^T (+ b) with B (out, in) split by input columns over `group`: X arrives split
    (b, s, in/tp), Y leaves whole (ALL_REDUCE) or sequence-sharded (SEQUENCE_PARALLEL). The bias b is
    replicated and added once, after the reduction; under SP each rank adds it to its s/tp rows, so
    its gradient is summed over TP (tp_grad_sum)."""

    def __init__(self, in_features: int, out_features: int, *, group: Group, mode: TPMode = TPMode.ALL_REDUCE,
                 bias: bool = False, dtype=None, device=None):
        super().__init__()
        self.group, self.mode = group, mode
        self.weight = _weight(self, group, (out_features, in_features), 1, even(in_features, group), dtype, device)
        self.bias = new_param(self, "bias", (out_features,), dtype=dtype, device=device) if bias else None
        if bias and mode is TPMode.SEQUENCE_PARALLEL:
            set_meta(self, "bias", tp_grad_sum=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = row_parallel(x, self.weight, self.group, self.mode)  # (b, s, out) or (b, s/tp, out)
        return y if self.bias is None else y + self.bias


def column_linears(x: torch.Tensor, linears: Sequence[nn.Module]) -> list[torch.Tensor]:
    """Apply several linears to the same x: plain `nn.Linear`s one by one, ColumnParallelLinears
    through one fused call (one gather forward, one all-reduce / reduce-scatter of dL/dX backward);
    their biases (this rank's output entries) are added after it."""
    if all(isinstance(m, ColumnParallelLinear) for m in linears):
        first = linears[0]
        ys = column_parallel(x, [m.weight for m in linears], first.group, first.mode)
        return [y if m.bias is None else y + m.bias for y, m in zip(ys, linears)]
    return [m(x) for m in linears]


class VocabParallelEmbedding(nn.Module):
    """E[ids] with the (V_padded, h) table split by rows: rank r holds rows [r V/tp, (r+1) V/tp).
    Each rank looks up the ids in its range (zeros elsewhere) and the partial rows are summed:
    all-reduce (ALL_REDUCE) or reduce-scatter along the sequence (SEQUENCE_PARALLEL, output
    (b, s/tp, h)). V_padded = vocab rounded up to a multiple of 128 x TP; padded rows are never
    looked up (ids < vocab) and the output layer's padded logits are masked in the loss."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: Group, mode: TPMode = TPMode.ALL_REDUCE,
                 dtype=None, device=None):
        super().__init__()
        self.group, self.mode = group, mode
        rows = even(num_embeddings, group)
        self.start, self.rows = rows.start, len(rows)
        self.weight = _weight(self, group, (num_embeddings, embedding_dim), 0, rows, dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        partial = F.embedding(local.masked_fill(outside, 0), self.weight)  # (b, s, h)
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.mode is TPMode.SEQUENCE_PARALLEL:
            return comm.reduce_scatter(partial, SEQ_DIM, self.group, "sp")  # (b, s/tp, h)
        return comm.reduce_from(partial, self.group, "tp")


def shard_state_dict(model: nn.Module, full_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A one-process state dict cut to `model`'s TP shards (entries of parameters without a `shard`
    pass through). Vocabulary matrices shorter than the TP-padded vocabulary get zero rows first."""
    specs = {n: m.shard for n, m in named_metas(model).items()}
    out = {}
    for name, full in full_state.items():
        spec = specs.get(name)
        if spec is not None and full.shape[0] < spec.full_shape[0] and tuple(full.shape[1:]) == spec.full_shape[1:]:
            full = torch.cat([full, full.new_zeros(spec.full_shape[0] - full.shape[0], *full.shape[1:])])
        out[name] = spec.of(full) if spec is not None else full
    return out


def mark_kv_replica(module: nn.Module, split: HeadSplit, kv_heads: int) -> None:
    """`module.weight` (and bias) is a whole KV head held by `split.kv_replicas` TP ranks (TP > KV heads)."""
    for name in ("weight", "bias"):
        if getattr(module, name, None) is not None:
            set_meta(module, name, kv_replica=KVReplica(split.kv_heads.start, kv_heads, split.kv_replicas))


def mark_sequence_sharded(module: nn.Module, *, replicated_only: bool = False) -> None:
    """Every parameter under `module` (with `replicated_only`, those that are not TP shards) is
    replicated but sees only this rank's sequence shard (norm gains under SP): tp_grad_sum."""
    mark_all(module, (lambda m: m.shard is None) if replicated_only else (lambda m: True), tp_grad_sum=True)


@torch.no_grad()
def reduce_tp_grads(params: Iterable[tuple[torch.Tensor, ParamMeta]], group: Group) -> None:
    """Complete the gradients of replicated parameters after backward (sums commute with the DP
    sum, so before or after it); `params` are (tensor, its metadata). Sequence-sharded ones
    (`tp_grad_sum`): one flat all-reduce over TP. KV replicas (`kv_replica`): each rank writes its
    gradient into its slot of a zero buffer of all slots; the all-reduce over TP then sums, per
    slot, exactly the replicas of that KV head."""
    if group.size == 1:
        return
    params = [(p, m) for p, m in params if p.grad is not None]
    summed = [p for p, m in params if m.tp_grad_sum]
    kv = [(p, m.kv_replica) for p, m in params if m.kv_replica is not None]
    if summed:
        flat = torch.cat([p.grad.reshape(-1) for p in summed])
        comm.all_reduce_(flat, group, "tp-grad")
        for p, g in zip(summed, flat.split([p.numel() for p in summed])):
            p.grad.copy_(g.view_as(p.grad))
    for p, rep in kv:
        buf = p.grad.new_zeros(rep.slots, *p.grad.shape)
        buf[rep.slot] = p.grad
        comm.all_reduce_(buf, group, "tp-grad")
        p.grad.copy_(buf[rep.slot])


def linear(in_features: int, out_features: int, *, tp: Group | None, split: str, mode: TPMode = TPMode.ALL_REDUCE,
           bias: bool = False, rows: range | None = None) -> nn.Module:
    """A plain nn.Linear without `tp`, else the `split` ("column" or "row") parallel linear over it."""
    if tp is None:
        return nn.Linear(in_features, out_features, bias=bias)
    if split == "column":
        return ColumnParallelLinear(in_features, out_features, group=tp, mode=mode, rows=rows, bias=bias)
    return RowParallelLinear(in_features, out_features, group=tp, mode=mode, bias=bias)
