"""Differentiable collectives: each an autograd.Function whose backward is its dual.

    copy_to  <-> reduce_from     (Megatron-LM's f and g of tensor parallelism)
    sum_shared                   (all-reduce both ways: a sum every rank then uses its own way)
    gather   <-> reduce_scatter  (Megatron's sequence-parallel g and g-bar)
    split    <-> gather_split    (keep own chunk / all-gather; Megatron's scatter/gather "to/from region")
    all_to_all <-> all_to_all with the scatter and gather dims swapped

Every one is the identity over a one-rank group (nothing counted, no graph node beyond the input).
The forward and backward communication is counted in `fivefold.runtime.traffic` under the caller's
tag; the backward's communication also logs start/end events. The raw (non-differentiable) ops are
re-exported here, so `from fivefold.runtime import comm` gives the whole surface.
"""
from __future__ import annotations

import torch

from fivefold.runtime import collectives as raw
from fivefold.runtime import traffic
from fivefold.runtime.collectives import (Work, all_gather, all_reduce_, all_reduce_async,  # noqa: F401
                                          all_to_all_single, barrier, broadcast_, send_recv)
from fivefold.runtime.mesh import Group


def _chunk(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's chunk of x along dim (x.shape[dim] / n rows), contiguous."""
    if x.shape[dim] % group.size:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} is not divisible by group {group.name} of size {group.size}")
    return x.chunk(group.size, dim)[group.rank].contiguous()


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Group, tag: str) -> torch.Tensor:
    """Chunk j of x along scatter_dim goes to rank j; received chunks are concatenated, in rank order,
    along gather_dim:  y_r = cat_j (chunk r of x_j along scatter_dim)  along gather_dim."""
    if x.shape[scatter_dim] % group.size:
        raise ValueError(f"all_to_all: dim {scatter_dim} of size {x.shape[scatter_dim]} is not divisible by {group.size}")
    stacked = torch.stack(x.chunk(group.size, scatter_dim))  # (n, ..., s_scatter/n, ...)
    received = raw.all_to_all_single(stacked, group, tag)  # (n, ...): received[j] from rank j
    return torch.cat(received.unbind(0), dim=gather_dim)


class CopyTo(torch.autograd.Function):
    """Megatron's f: Y = X forward; dL/dX = sum over the group of dL/dY backward (all-reduce).
    Enters a tensor-parallel region whose ranks each use X and produce partial gradients."""

    @staticmethod
    def forward(ctx, x, group, tag):
        ctx.group, ctx.tag = group, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        with traffic.span("all_reduce", ctx.tag):
            grad = raw.all_reduce_(grad.clone(memory_format=torch.contiguous_format), ctx.group, ctx.tag)
        return grad, None, None


class ReduceFrom(torch.autograd.Function):
    """Megatron's g: Y = sum over the group of X_r forward (all-reduce); dL/dX = dL/dY backward.
    Leaves a tensor-parallel region whose ranks each hold a partial sum."""

    @staticmethod
    def forward(ctx, x, group, tag):
        return raw.all_reduce_(x.clone(memory_format=torch.contiguous_format), group, tag)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class SumShared(torch.autograd.Function):
    """Y = sum over the group of X_r forward (all-reduce), and every rank uses Y its own way (a statistic
    of features split over TP: the sum of squares of a TP-split RMSNorm); so dL/dX_r = sum over the
    group of dL/dY_q backward (all-reduce): Megatron's g applied after f, forward g's, backward f's."""

    @staticmethod
    def forward(ctx, x, group, tag):
        ctx.group, ctx.tag = group, tag
        return raw.all_reduce_(x.clone(memory_format=torch.contiguous_format), group, tag)

    @staticmethod
    def backward(ctx, grad):
        with traffic.span("all_reduce", ctx.tag):
            grad = raw.all_reduce_(grad.clone(memory_format=torch.contiguous_format), ctx.group, ctx.tag)
        return grad, None, None


class Gather(torch.autograd.Function):
    """Y = cat_r X_r along dim forward (all-gather); dL/dX_r = chunk r of sum_q dL/dY_q backward
    (reduce-scatter). Megatron's sequence-parallel g: each rank's Y feeds its own partial compute."""

    @staticmethod
    def forward(ctx, x, dim, group, tag):
        ctx.dim, ctx.group, ctx.tag = dim, group, tag
        return raw.all_gather(x, dim, group, tag)

    @staticmethod
    def backward(ctx, grad):
        with traffic.span("reduce_scatter", ctx.tag):
            grad = raw.reduce_scatter(grad, ctx.dim, ctx.group, ctx.tag)
        return grad, None, None, None


class ReduceScatter(torch.autograd.Function):
    """Y_r = chunk r along dim of sum_q X_q forward (reduce-scatter); dL/dX = cat_q dL/dY_q backward
    (all-gather). Megatron's sequence-parallel g-bar."""

    @staticmethod
    def forward(ctx, x, dim, group, tag):
        ctx.dim, ctx.group, ctx.tag = dim, group, tag
        return raw.reduce_scatter(x, dim, group, tag)

    @staticmethod
    def backward(ctx, grad):
        with traffic.span("all_gather", ctx.tag):
            grad = raw.all_gather(grad, ctx.dim, ctx.group, ctx.tag)
        return grad, None, None, None


class Split(torch.autograd.Function):
    """Y_r = chunk r of X along dim forward (no communication; X is the same on every rank);
    dL/dX = cat_q dL/dY_q backward (all-gather). Megatron's scatter_to_tensor_model_parallel_region."""

    @staticmethod
    def forward(ctx, x, dim, group, tag):
        ctx.dim, ctx.group, ctx.tag = dim, group, tag
        return _chunk(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        with traffic.span("all_gather", ctx.tag):
            grad = raw.all_gather(grad, ctx.dim, ctx.group, ctx.tag)
        return grad, None, None, None


class GatherSplit(torch.autograd.Function):
    """Y = cat_r X_r along dim forward (all-gather; every rank then uses Y identically);
    dL/dX_r = chunk r of dL/dY backward (no communication). The dual of Split; Megatron's
    gather_from_tensor_model_parallel_region."""

    @staticmethod
    def forward(ctx, x, dim, group, tag):
        ctx.dim, ctx.group = dim, group
        return raw.all_gather(x, dim, group, tag)

    @staticmethod
    def backward(ctx, grad):
        return _chunk(grad, ctx.dim, ctx.group), None, None, None


class AllToAll(torch.autograd.Function):
    """Y_r = cat_j (chunk r of X_j along scatter_dim) along gather_dim forward; backward is the same
    exchange with the dims swapped (the all-to-all is a permutation of blocks; its adjoint is the
    inverse permutation). Used by Ulysses-style context parallelism and MoE dispatch."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group, tag):
        ctx.dims, ctx.group, ctx.tag = (scatter_dim, gather_dim), group, tag
        return _all_to_all(x, scatter_dim, gather_dim, group, tag)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        with traffic.span("all_to_all", ctx.tag):
            grad = _all_to_all(grad, gather_dim, scatter_dim, ctx.group, ctx.tag)
        return grad, None, None, None, None


def copy_to(x: torch.Tensor, group: Group, tag: str) -> torch.Tensor:
    """Megatron f: identity forward, all-reduce backward."""
    return x if group.size == 1 else CopyTo.apply(x, group, tag)


def reduce_from(x: torch.Tensor, group: Group, tag: str) -> torch.Tensor:
    """Megatron g: all-reduce forward, identity backward."""
    return x if group.size == 1 else ReduceFrom.apply(x, group, tag)


def sum_shared(x: torch.Tensor, group: Group, tag: str) -> torch.Tensor:
    """All-reduce forward and backward: the group's sum, which each rank uses differently."""
    return x if group.size == 1 else SumShared.apply(x, group, tag)


def gather(x: torch.Tensor, dim: int, group: Group, tag: str) -> torch.Tensor:
    """All-gather along dim forward, reduce-scatter backward."""
    return x if group.size == 1 else Gather.apply(x, dim, group, tag)


def reduce_scatter(x: torch.Tensor, dim: int, group: Group, tag: str, async_op: bool = False):
    """Reduce-scatter along dim forward, all-gather backward. With `async_op` (gradient buffers,
    ZeRO): the raw op, returning (tensor, Work), not differentiable."""
    if async_op:
        return raw.reduce_scatter(x, dim, group, tag, async_op=True)
    return x if group.size == 1 else ReduceScatter.apply(x, dim, group, tag)


def split(x: torch.Tensor, dim: int, group: Group, tag: str) -> torch.Tensor:
    """Keep this rank's chunk along dim forward (no comm), all-gather backward."""
    return x if group.size == 1 else Split.apply(x, dim, group, tag)


def gather_split(x: torch.Tensor, dim: int, group: Group, tag: str) -> torch.Tensor:
    """All-gather along dim forward, keep own chunk backward (the dual of split)."""
    return x if group.size == 1 else GatherSplit.apply(x, dim, group, tag)


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Group, tag: str) -> torch.Tensor:
    """All-to-all forward (scatter along scatter_dim, gather along gather_dim), swapped backward."""
    return x if group.size == 1 else AllToAll.apply(x, scatter_dim, gather_dim, group, tag)
