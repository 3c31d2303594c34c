"""Raw collectives over a `Group` (not differentiable), each counted in `fivefold.runtime.traffic`
and marked in this rank's heartbeat while it blocks (`fivefold.runtime.heartbeat.in_flight`: what a
hang watchdog names), asynchronous ops while their `Work.wait()` blocks.

Every op is the identity (and uncounted) over a one-rank group. Gathers and scatters along a dim other
than 0 move that dim to the front, make the tensor contiguous, run the flat op, and move it back
(torch's all_gather_single / reduce_scatter_single work on dim 0 only).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from fivefold.runtime import heartbeat, traffic
from fivefold.runtime.mesh import Group

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""torch 2.13's names; torch 2.11-2.12 have the same ops (same arguments) only as `*_into_tensor` /
`*_tensor`, which 2.13 deprecates."""

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class Work:
    """A launched asynchronous op. `wait()` blocks until it is done, logs the "end" event (once) and
    runs the finishing step (e.g. moving a gathered dim back into place)."""

    def __init__(self, works: list, kind: str, tag: str, then: Callable[[], None] | None = None, group: str = ""):
        self._works, self.kind, self.tag, self._then, self.group = works, kind, tag, then, group
        self._done = False
        if works:
            traffic.event(kind, tag, "start")

    def wait(self) -> bool:
        if not self._done:
            if self._works:
                with heartbeat.in_flight(self.kind, self.tag, self.group):
                    for w in self._works:
                        w.wait()
                traffic.event(self.kind, self.tag, "end")
            if self._then is not None:
                self._then()
            # the backend's work may hold the call's buffers (gloo: a full-size copy of a reduce-scatter's
            # input; the output chunk): drop it, or they live as long as whoever keeps this Work
            self._works, self._then, self._done = [], None, True
        return True

    def is_completed(self) -> bool:
        """Whether every underlying op has finished, without blocking (and without the finishing step)."""
        return self._done or all(w.is_completed() for w in self._works)


def _alone(group: Group) -> bool:
    return group.pg is None


def all_reduce_(t: torch.Tensor, group: Group, tag: str, op: str = "sum") -> torch.Tensor:
    """t <- op over the group of t (in place). Counted: t's bytes."""
    if not _alone(group):
        traffic.record("all_reduce", tag, group.name, t.nbytes)
        with heartbeat.in_flight("all_reduce", tag, group.name):
            dist.all_reduce(t, op=_OPS[op], group=group.pg)
    return t


def all_reduce_async(t: torch.Tensor, group: Group, tag: str, op: str = "sum") -> Work:
    """Launch t <- op over the group of t (in place); the result is there after `Work.wait()`."""
    if _alone(group):
        return Work([], "all_reduce", tag)
    traffic.record("all_reduce", tag, group.name, t.nbytes)
    return Work([dist.all_reduce(t, op=_OPS[op], group=group.pg, async_op=True)], "all_reduce", tag,
                group=group.name)


def all_gather(t: torch.Tensor, dim: int, group: Group, tag: str, async_op: bool = False):
    """cat over group ranks r of t_r along `dim`. Counted: the gathered output's bytes.
    Returns the tensor, or (tensor, Work) with `async_op` (the tensor is valid after wait)."""
    if _alone(group):
        return (t, Work([], "all_gather", tag)) if async_op else t
    dim = dim % t.dim()
    front = t.movedim(dim, 0).contiguous()  # (s_d, ...rest)
    flat = front.new_empty((group.size * front.shape[0], *front.shape[1:]))  # (n*s_d, ...rest)
    traffic.record("all_gather", tag, group.name, flat.nbytes)
    if not async_op:
        with heartbeat.in_flight("all_gather", tag, group.name):
            _all_gather_single(flat, front, group=group.pg)
        return flat.movedim(0, dim).contiguous()
    work = _all_gather_single(flat, front, group=group.pg, async_op=True)
    if dim == 0:  # flat is the result already (ZeRO's parameter gather): no second buffer, no copy
        return flat, Work([work], "all_gather", tag, group=group.name)
    shape = list(t.shape)
    shape[dim] *= group.size
    out = t.new_empty(shape)
    return out, Work([work], "all_gather", tag, then=lambda: out.copy_(flat.movedim(0, dim)), group=group.name)


def reduce_scatter(t: torch.Tensor, dim: int, group: Group, tag: str, async_op: bool = False):
    """Chunk r (along `dim`, t.shape[dim] / n each) of the sum over ranks, on group rank r.
    Counted: the unscattered input's bytes. Returns the tensor, or (tensor, Work) with `async_op`."""
    if _alone(group):
        return (t, Work([], "reduce_scatter", tag)) if async_op else t
    dim = dim % t.dim()
    if t.shape[dim] % group.size:
        raise ValueError(f"reduce_scatter: dim {dim} of size {t.shape[dim]} is not divisible by {group.size}")
    front = t.movedim(dim, 0).contiguous()  # (n*c, ...rest)
    chunk = front.new_empty((front.shape[0] // group.size, *front.shape[1:]))  # (c, ...rest)
    traffic.record("reduce_scatter", tag, group.name, front.nbytes)
    if not async_op:
        with heartbeat.in_flight("reduce_scatter", tag, group.name):
            _reduce_scatter_single(chunk, front, group=group.pg)
        return chunk.movedim(0, dim).contiguous()
    work = _reduce_scatter_single(chunk, front, group=group.pg, async_op=True)
    if dim == 0:  # chunk is the result already (gradient buckets): no second buffer, no copy
        return chunk, Work([work], "reduce_scatter", tag, group=group.name)
    shape = list(t.shape)
    shape[dim] //= group.size
    out = t.new_empty(shape)
    return out, Work([work], "reduce_scatter", tag, then=lambda: out.copy_(chunk.movedim(0, dim)),
                     group=group.name)


def all_to_all_single(t: torch.Tensor, group: Group, tag: str, in_splits: list[int] | None = None,
                      out_splits: list[int] | None = None) -> torch.Tensor:
    """Rows in_splits[j] of t (along dim 0, in order) go to group rank j; the output stacks the rows
    received from ranks 0..n-1 (out_splits[j] from rank j). Even splits when both are None.
    Counted: the input's bytes."""
    if (in_splits is None) != (out_splits is None):
        raise ValueError("all_to_all_single: give both in_splits and out_splits, or neither")
    if _alone(group):
        return t
    t = t.contiguous()
    rows = t.shape[0] if out_splits is None else sum(out_splits)
    out = t.new_empty((rows, *t.shape[1:]))
    traffic.record("all_to_all", tag, group.name, t.nbytes)
    with heartbeat.in_flight("all_to_all", tag, group.name):
        dist.all_to_all_single(out, t, out_splits, in_splits, group=group.pg)
    return out


def broadcast_(t: torch.Tensor, src_global_rank: int, group: Group, tag: str) -> torch.Tensor:
    """t <- t of global rank `src_global_rank` (in place). Counted: t's bytes."""
    if not _alone(group):
        traffic.record("broadcast", tag, group.name, t.nbytes)
        with heartbeat.in_flight("broadcast", tag, group.name):
            dist.broadcast(t, src=src_global_rank, group=group.pg)
    return t


def send_recv(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
              tag: str) -> list[Work]:
    """Batched isend / irecv with global peer ranks; recv tensors are preallocated by the caller.
    Returns one Work per op (sends first). Counted: each tensor sent ("send") and received ("recv"),
    group name "p2p"."""
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
    if not ops:
        return []
    for t, _ in sends:
        traffic.record("send", tag, "p2p", t.nbytes)
    for t, _ in recvs:
        traffic.record("recv", tag, "p2p", t.nbytes)
    kinds = ["send"] * len(sends) + ["recv"] * len(recvs)
    works = dist.batch_isend_irecv(ops)
    peers = [peer for _, peer in sends] + [peer for _, peer in recvs]
    return [Work([w], k, tag, group=f"p2p peer={p}") for w, k, p in zip(works, kinds, peers)]


def barrier(group: Group) -> None:
    """Wait for every rank of the group (not counted: no payload)."""
    if not _alone(group):
        with heartbeat.in_flight("barrier", "barrier", group.name):
            dist.barrier(group=group.pg)
