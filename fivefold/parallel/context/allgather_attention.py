"""All-gather context parallelism (cp_comm_type allgather: TransformerEngine's all_gather exchange,
Llama 3's "all-gather based method"), forward and backward.

Rank r of n holds Q, K, V of chunks r and 2n-1-r of a 2n split of the sequence (c tokens each, the
load-balanced split ring attention uses). Forward: K and V are all-gathered from the group (rank j's
two chunks at [2jc, 2(j+1)c) of the gathered tensors) and put in position order; each local query
chunk x then attends to the keys before it in full and to its own chunk causally: two kernel calls
merged by log-sum-exp as ring attention merges them (a causal call over a prefix of keys would need
bottom-right alignment). Only q, the local k, v and the merged O and L are saved, not the gathered
K/V: backward gathers them again, takes each block's gradients from the merged O and L (as
RingAttention.backward does; the keys before a chunk a chunk at a time, so a call's dK / dV
temporary is a chunk's, not the prefix's), and reduce-scatters the whole-sequence dK / dV back to their chunks.
Per layer and microbatch: two all-gathers forward, two backward, two reduce-scatters backward, each of
the whole sequence's K or V of this rank's KV heads, on the critical path (TransformerEngine's are not
overlapped either); `planner.collectives.cp_collectives` counts the same.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from fivefold.ops.attention import Documents, block_backward, block_forward
from fivefold.parallel.context.chunks import chunk_ids, local_positions
from fivefold.parallel.context.ring_attention import merge_
from fivefold.runtime import collectives as raw
from fivefold.runtime import traffic
from fivefold.runtime.mesh import Group


@lru_cache(maxsize=16)
def _gathered_order(n: int, c: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, order): the global positions of the gathered sequence in CP-index order (rank j's two
    chunks at [2jc, 2(j+1)c)), and their argsort, which puts it in position order (once per shape, not
    per layer)."""
    positions = torch.cat([local_positions(2 * c, n, j, device) for j in range(n)])
    return positions, torch.argsort(positions)


def _query_chunks(r: int, n: int, c: int) -> list[tuple[slice, int]]:
    """This rank's two query chunks: (their rows in the local q, their chunk index x in the sequence)."""
    return [(slice(i * c, (i + 1) * c), x) for i, x in enumerate(chunk_ids(n, r))]


def _blocks(x: int, c: int, docs: Documents | None, tiled: bool = False):
    """The key blocks chunk x attends to: (keys, causal, document pieces), its own chunk first, then
    the keys before it as one block or (`tiled`, backward: each call's dK / dV temporary stays a
    chunk's) chunk by chunk."""
    rows = torch.arange(x * c, (x + 1) * c)
    out = [(slice(x * c, (x + 1) * c), True, docs.pieces(rows, rows, causal=True) if docs else None)]
    before = [(y * c, (y + 1) * c) for y in range(x)] if tiled else [(0, x * c)] if x else []
    for lo, hi in before:
        out.append((slice(lo, hi), False, docs.pieces(rows, torch.arange(lo, hi), causal=False) if docs else None))
    return [(keys, causal, pieces) for keys, causal, pieces in out if pieces is None or pieces]


class AllGatherAttention(torch.autograd.Function):
    """Causal attention over the group's load-balanced chunks with K/V all-gathered (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, group: Group, tag: str, scale: float, docs: Documents | None):
        with torch.autocast(q.device.type, enabled=False):  # blocks in q's dtype whatever the caller's autocast
            return AllGatherAttention._forward(ctx, q, k, v, group, tag, scale, docs)

    @staticmethod
    def _forward(ctx, q, k, v, group: Group, tag: str, scale: float, docs):
        n, c = group.size, q.shape[2] // 2
        _, order = _gathered_order(n, c, q.device)
        k_all, v_all = (raw.all_gather(t, 2, group, tag)[:, :, order] for t in (k, v))  # (b, g, s, d|dv)
        out = q.new_empty((*q.shape[:3], v.shape[-1]), dtype=torch.float32)
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
        with traffic.span("compute", tag):
            for rows, x in _query_chunks(group.rank, n, c):
                first = True
                for keys, causal, pieces in _blocks(x, c, docs):
                    o_i, l_i = block_forward(q[:, :, rows], k_all[:, :, keys], v_all[:, :, keys], scale, causal, pieces)
                    if first:  # the own block gives every row at least itself
                        out[:, :, rows], lse[:, :, rows] = o_i.float(), l_i
                        first = False
                    else:
                        merge_(out[:, :, rows], lse[:, :, rows], o_i, l_i)
                    del o_i, l_i
        del k_all, v_all
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.tag, ctx.scale, ctx.docs = group, tag, scale, docs
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        with torch.autocast(do.device.type, enabled=False):
            return AllGatherAttention._backward(ctx, do)

    @staticmethod
    def _backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        group, tag, scale = ctx.group, ctx.tag, ctx.scale
        n, c = group.size, q.shape[2] // 2
        positions, order = _gathered_order(n, c, q.device)
        with traffic.span("all_gather", tag):
            k_all, v_all = (raw.all_gather(t, 2, group, tag)[:, :, order] for t in (k, v))
        do, out_c = do.to(q.dtype), out.to(q.dtype)  # the kernels take O in the compute dtype
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk_all = torch.zeros(k_all.shape, dtype=torch.float32, device=k.device)
        dv_all = torch.zeros(v_all.shape, dtype=torch.float32, device=v.device)
        with traffic.span("compute", tag):
            for rows, x in _query_chunks(group.rank, n, c):
                for keys, causal, pieces in _blocks(x, c, ctx.docs, tiled=True):
                    dq_t, dk_t, dv_t = block_backward(do[:, :, rows], q[:, :, rows], k_all[:, :, keys],
                                                      v_all[:, :, keys], out_c[:, :, rows], lse[:, :, rows], scale,
                                                      causal, pieces)
                    dq[:, :, rows] += dq_t
                    dk_all[:, :, keys] += dk_t
                    dv_all[:, :, keys] += dv_t
                    del dq_t, dk_t, dv_t
        del k_all, v_all
        with traffic.span("reduce_scatter", tag):  # back in CP-index order: each rank gets its own two chunks
            dk, dv = (raw.reduce_scatter(g[:, :, positions].to(t.dtype), 2, group, tag)
                      for g, t in ((dk_all, k), (dv_all, v)))
        return dq.to(q.dtype), dk, dv, None, None, None, None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, *, tag: str = "cp",
                        scale: float | None = None, docs: Documents | None = None) -> torch.Tensor:
    """q (b, a, s_loc, d), k (b, g, s_loc, d), v (b, g, s_loc, dv) of this rank's two chunks ->
    (b, a, s_loc, dv): causal attention over the whole sequence, K/V all-gathered over `group`
    (a % g == 0; scale default 1/sqrt(d)); with `docs` (global boundaries of the s_loc * group.size
    tokens) each document attends to itself."""
    if q.shape[2] % 2:
        raise ValueError(f"all-gather attention needs an even local sequence (two chunks), got {q.shape[2]}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return AllGatherAttention.apply(q, k, v, group, tag, scale, docs)
