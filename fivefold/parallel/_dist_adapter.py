"""TEMPORARY thin adapter over torch.distributed until fivefold.runtime.comm lands; then deleted.

Same calls the runtime's counted collectives will offer: an async all-reduce with a tag, and an
event log of (op, tag, phase, time) that tests read to assert overlap.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

EVENTS: list[tuple[str, str, str, float]] = []


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _Done:
    def wait(self):
        return True


class _Work:
    def __init__(self, work, tag):
        self.work, self.tag = work, tag

    def wait(self):
        self.work.wait()
        EVENTS.append(("all_reduce", self.tag, "end", time.perf_counter()))
        return True


def all_reduce_async(t: torch.Tensor, group, tag: str):
    if _size(group) == 1:
        return _Done()
    EVENTS.append(("all_reduce", tag, "start", time.perf_counter()))
    return _Work(dist.all_reduce(t, group=group, async_op=True), tag)


def all_reduce(t: torch.Tensor, group, tag: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if _size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def all_gather(t: torch.Tensor, group, tag: str) -> torch.Tensor:
    if _size(group) == 1:
        return t.unsqueeze(0)
    out = [torch.empty_like(t) for _ in range(_size(group))]
    dist.all_gather(out, t, group=group)
    return torch.stack(out)


def barrier(group) -> None:
    if _size(group) > 1:
        dist.barrier(group=group)
