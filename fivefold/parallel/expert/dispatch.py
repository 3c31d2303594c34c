"""Expert parallelism (EP) and expert tensor parallelism (ETP): routed tokens to their experts and back.

EP (GShard / Megatron's all-to-all token dispatcher) over the `ep` group of n ranks: rank r holds
the E/n experts [r E/n, (r+1) E/n). For this rank's tokens x (t, h) and their top-k experts:
  permute : the t*k (token, expert) assignments sorted by expert -> rows (t k, h); rows for rank j's
            experts are contiguous, in expert order;
  counts  : all-to-all of the per-expert counts (E,) int64, so each rank learns how many rows it
            receives from each rank for each of its experts;
  dispatch: all-to-all of the rows, uneven splits -> (R, h), from rank 0's rows to rank n-1's;
  experts : the received rows grouped by local expert, each through its expert's SwiGLU;
  combine : the reverse all-to-all -> (t k, h) in permuted order, un-permuted, and
            y_t = sum_k w_tk expert_k(x_t)  with the router weights w.
Both all-to-alls are autograd functions whose backward is the all-to-all with the splits swapped.

ETP over the `etp` group of m ranks: every expert's gate/up are split by output rows and down by
input columns (Megatron's column / row parallel linears, the same `Shard` slices of their ParamMeta as TP, so they
initialise and checkpoint like TP shards). The m ranks hold different tokens (each its own sequence
shard), so the rows are all-gathered over ETP (padded to the largest row count of the group),
every rank applies its f/m slice of each expert to all of them, and the partial outputs
P_r = silu(X G_r^T) * (X U_r^T) D_r^T, Y = sum_r P_r, are reduce-scattered back to their ranks:
the SP form of a column -> row parallel pair, with the rows of all ranks as the "sequence".
Bytes: docs/derivations/ep_bytes.md (summary in docs/moe.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.errors import NotImplementedYet, UserError
from fivefold.ops.counting import bincount
from fivefold.parallel.data.reducer import add_stacked_grads
from fivefold.runtime import comm, traffic
from fivefold.runtime.backward_pass import weight_grads_wanted
from fivefold.runtime.collectives import all_to_all_single
from fivefold.runtime.mesh import Group

def local_experts(num_experts: int, ep: Group | None) -> range:
    """The global indices of the experts this EP rank holds."""
    n = ep.size if ep is not None else 1
    per = num_experts // n
    r = ep.rank if ep is not None else 0
    return range(r * per, (r + 1) * per)


class _AllToAllV(torch.autograd.Function):
    """Rows in_splits[j] of x go to rank j, out_splits[j] arrive from rank j; backward: the same
    all-to-all of the gradient with the splits swapped (its dual)."""

    @staticmethod
    def forward(ctx, x, group: Group, tag: str, in_splits: list[int], out_splits: list[int]):
        ctx.group, ctx.tag, ctx.splits = group, tag, (in_splits, out_splits)
        return all_to_all_single(x, group, tag, in_splits, out_splits)

    @staticmethod
    def backward(ctx, grad):
        in_splits, out_splits = ctx.splits
        with traffic.span("all_to_all", ctx.tag):
            return all_to_all_single(grad, ctx.group, ctx.tag, out_splits, in_splits), None, None, None, None


def all_to_all_v(x: torch.Tensor, group: Group, tag: str, in_splits: list[int], out_splits: list[int]) -> torch.Tensor:
    return _AllToAllV.apply(x, group, tag, in_splits, out_splits)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def swiglu_rows(expert: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x) with the expert's own (possibly ETP-sliced) weights; x (m, h)."""
    return F.linear(F.silu(F.linear(x, expert.gate_proj.weight)) * F.linear(x, expert.up_proj.weight),
                    expert.down_proj.weight)  # (m, h), a partial sum over ETP ranks when sliced


def _run_local(x: torch.Tensor, counts: torch.Tensor, experts: list[nn.Module], grouped: bool) -> torch.Tensor:
    """x (R, h) grouped by local expert (counts[e] rows each) -> each group through its expert: one
    matmul per expert, or with `grouped` one grouped matmul per projection for all of them (the counts
    stay on the device: no wait for them)."""
    if grouped:
        return _grouped_swiglu(x, counts, experts)
    outs = [swiglu_rows(e, rows) for e, rows in zip(experts, x.split(counts.tolist())) if rows.shape[0]]
    return torch.cat(outs) if outs else x[:0] * 0  # (R, h); empty stays in the graph


class _GroupedMM(torch.autograd.Function):
    """Rows [offsets[e-1], offsets[e]) of x (R, in) times weights[e]^T ((out, in), an nn.Linear weight),
    keeping the weights themselves for backward. torch._grouped_mm wants them stacked, (E, in, out),
    and its own autograd keeps that stacked copy until backward: per projection, every local expert's
    weight once more per layer and microbatch in flight (192 MiB a layer for 64 experts of 1024 x 512
    in bf16; measured on an H200, benchmarks/RESULTS.md). The backward stacks them again (a transient)
    and runs the two grouped matmuls torch's autograd runs, bit for bit (tests/test_moe.py)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, offsets: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, offsets, *weights)
        return torch._grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, offsets, *weights = ctx.saved_tensors
        dy = dy.contiguous()  # _grouped_mm refuses the stride-0 gradients that sums and broadcasts hand back
        dx = torch._grouped_mm(dy, torch.stack(weights), offs=offsets) if ctx.needs_input_grad[0] else None
        if not any(ctx.needs_input_grad[2:]):
            return dx, None, *(None,) * len(weights)
        dw = torch._grouped_mm(dy.t(), x, offs=offsets)  # (E, out, in): each expert's weight gradient
        if weight_grads_wanted() and add_stacked_grads(weights, dw):  # (a zero-bubble B pass drops them)
            return dx, None, *(None,) * len(weights)  # in the buffers already, and counted
        return dx, None, *dw.unbind(0)


def _grouped(x: torch.Tensor, weights: list[torch.Tensor], offsets: torch.Tensor) -> torch.Tensor:
    """Rows [offsets[e-1], offsets[e]) of x (R, in) times weights[e]^T ((out, in), an nn.Linear weight)."""
    return _GroupedMM.apply(x, offsets, *weights)


def _grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, experts: list[nn.Module]) -> torch.Tensor:
    """swiglu_rows of every expert on its rows, as three grouped matmuls (torch._grouped_mm)."""
    inner = experts[0].down_proj.weight.shape[1]  # the expert width on this rank (f / ETP)
    if (x.shape[1] * x.element_size()) % 16 or (inner * x.element_size()) % 16:
        raise UserError(f"model.moe_grouped_gemm: torch._grouped_mm needs rows of a multiple of 16 bytes; hidden "
                        f"{x.shape[1]} and the expert width per ETP rank {inner} in {x.dtype} are not; use widths "
                        f"that are multiples of {16 // x.element_size()}, or moe_grouped_gemm=false")
    offsets = counts.to(x.device).cumsum(0).to(torch.int32)  # (E_loc,) end of each group
    gate = _grouped(x, [e.gate_proj.weight for e in experts], offsets)
    up = _grouped(x, [e.up_proj.weight for e in experts], offsets)
    return _grouped(F.silu(gate) * up, [e.down_proj.weight for e in experts], offsets)  # (R, h)


def use_grouped_gemm(setting: bool | None, device: torch.device) -> bool:
    """model.moe_grouped_gemm on `device`: None chooses the grouped matmul on CUDA and the loop elsewhere."""
    if setting is None:
        return device.type == "cuda"
    if setting and not hasattr(torch, "_grouped_mm"):
        raise NotImplementedYet(f"model.moe_grouped_gemm: this torch ({torch.__version__}) has no torch._grouped_mm; "
                                "set moe_grouped_gemm=false (the per-expert loop, the same math)")
    return setting


def run_experts(x: torch.Tensor, counts: torch.Tensor, experts: list[nn.Module], etp: Group | None,
                grouped: bool = False) -> torch.Tensor:
    """x (R, h) grouped by local expert (`counts` (E_loc,) int64) -> expert outputs (R, h)."""
    if etp is None or etp.size == 1:
        return _run_local(x, counts, experts, grouped)
    every = comm.all_gather(counts.unsqueeze(0), 0, etp, "etp")  # (m, E_loc): rows per rank, per expert
    totals = every.sum(1)  # (m,)
    pad = int(totals.max())
    x_pad = torch.cat([x, x.new_zeros(pad - x.shape[0], x.shape[1])])  # (Rmax, h)
    gathered = comm.gather(x_pad, 0, etp, "etp")  # (m Rmax, h): rank r's rows at [r Rmax, r Rmax + R_r)
    starts = torch.cumsum(every, 1) - every  # (m, E_loc): where expert e's rows start in rank r's block
    order = [torch.arange(r * pad + int(starts[r, e]), r * pad + int(starts[r, e] + every[r, e]))
             for e in range(every.shape[1]) for r in range(every.shape[0])]
    perm = torch.cat(order).to(x.device)  # the gathered rows, grouped by expert
    y = _run_local(gathered[perm], every.sum(0), experts, grouped)  # (sum R_r, h) partial over ETP
    # (m Rmax, h); padding rows stay 0. index_put keeps only the indices for backward (index_copy
    # would keep y, every gathered row: measured, a MoE layer under ETP2 held 1 MiB more of 6)
    partial = y.new_zeros(gathered.shape).index_put((perm,), y)
    return comm.reduce_scatter(partial, 0, etp, "etp")[: x.shape[0]]  # (R, h): this rank's rows, summed


def moe_forward(x: torch.Tensor, experts_idx: torch.Tensor, weights: torch.Tensor, experts: list[nn.Module],
                num_experts: int, ep: Group | None, etp: Group | None, keep: torch.Tensor | None = None,
                pad_to: int | None = None, grouped: bool = False) -> torch.Tensor:
    """y_t = sum_j weights[t, j] * expert_{experts_idx[t, j]}(x_t) for this rank's tokens x (t, h),
    `experts` the local ones (local_experts(num_experts, ep)); see the module docstring. `keep` (t, k)
    bool: only those assignments are computed (token dropping, fivefold.model.capacity), the others
    add 0. `pad_to`: every expert gets exactly that many rows, zero rows filling (static shapes;
    zero rows give zero outputs and gradients, so the result is the same)."""
    t, k = experts_idx.shape
    flat = experts_idx.reshape(-1)  # (t k,)
    kept = None if keep is None else keep.reshape(-1).nonzero().squeeze(1)  # the computed assignments
    if kept is not None:
        flat = flat[kept]
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert, tokens in order
    rows = x[(order if kept is None else kept[order]) // k]  # (a, h)
    counts = bincount(flat, num_experts)  # (E,)
    slots = None
    if pad_to is not None:  # row i of expert e goes to slot e * pad_to + i
        starts = torch.cumsum(counts, 0) - counts
        by_expert = flat[order]
        slots = by_expert * pad_to + torch.arange(len(order), device=x.device) - starts[by_expert]
        # index_put keeps only the slots for backward (index_copy would save a copy of the rows)
        rows = rows.new_zeros(num_experts * pad_to, rows.shape[1]).index_put((slots,), rows)  # (E pad_to, h)
        counts = torch.full_like(counts, pad_to)
    n = ep.size if ep is not None else 1
    if n > 1:
        received = all_to_all_single(counts, ep, "ep").view(n, -1)  # (n, E_loc): from rank j, per local expert
        in_splits = counts.view(n, -1).sum(1).tolist()
        out_splits = received.sum(1).tolist()
        rows = all_to_all_v(rows, ep, "ep", in_splits, out_splits)  # (R, h), by source rank then expert
        local_of_row = torch.arange(received.shape[1], device=x.device).repeat(n).repeat_interleave(received.reshape(-1))
        by_expert = torch.argsort(local_of_row, stable=True)
        y = run_experts(rows[by_expert], received.sum(0), experts, etp, grouped)[_inverse(by_expert)]  # (R, h)
        y = all_to_all_v(y, ep, "ep", out_splits, in_splits)  # (a or E pad_to, h), permuted order
    else:
        y = run_experts(rows, counts, experts, etp, grouped)  # (a or E pad_to, h)
    if slots is not None:
        y = y[slots]  # (a, h): the real rows back
    y = y[_inverse(order)]  # (a, h): assignment order
    if kept is not None:
        y = y.new_zeros(t * k, y.shape[1]).index_put((kept,), y)  # dropped assignments: 0 (index_put: as above)
    y = y.view(t, k, -1)  # (t, k, h): assignment (token, j)
    # In the weights' dtype when it is wider (moe_router_dtype fp32 / fp64 under bf16, as Megatron's unpermute)
    dtype = torch.promote_types(y.dtype, weights.dtype)
    return (y.to(dtype) * weights.unsqueeze(-1)).sum(1).to(y.dtype)  # (t, h)
