"""Weight sync: every parameter of one model copy (a trainer) into another copy of the same model in
another layout (an inference copy), on the same ranks, moving only the bytes that must move.

Each rank knows where every rank's slices sit in the one-process tensors (ParamMeta placements,
shared once with an all-gather of small descriptions). For every destination slice, each part comes
from one source slice that holds it: a slice on the same rank if there is one (a local copy, no
traffic), else the first rank holding it in rank order — data-parallel replicas of the source do not
all send. So every destination element crosses the network at most once, and not at all when its
rank already has it: the bytes sent are the minimum (`planned_bytes`; tests/test_engine_sync.py
checks them against the count written out another way). Transfers are point-to-point sends and
receives, all posted before any is waited.

Both copies run on the same ranks here (colocated, verl's and SkyRL's default); copies on disjoint
rank sets (several models in one world) are not built yet.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fivefold.checkpoint.io import buffers_saved
from fivefold.checkpoint.layout import inside, overlap
from fivefold.errors import NotImplementedYet
from fivefold.parallel.param_meta import named_metas
from fivefold.runtime import traffic


@dataclass(frozen=True)
class Move:
    name: str
    src: int
    dst: int
    src_slices: tuple[slice, ...]
    dst_slices: tuple[slice, ...]
    numel: int


def _placements(model: nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """This rank's parameters: name -> (offsets, shape, the one-process tensor's shape)."""
    metas = named_metas(model)
    out = {}
    for n, p in model.named_parameters():
        whole, offsets = metas[n].placement(tuple(p.shape))
        out[n] = (tuple(offsets), tuple(p.shape), tuple(whole))
    return out


def plan(sources: list[dict], destinations: list[dict]) -> list[Move]:
    """Moves for every rank's destination slices (index = rank) from the source slices (index = rank)."""
    moves = []
    for dst, held in enumerate(destinations):
        for name, (d_off, d_shape, _) in sorted(held.items()):
            owners = [r for r, src in enumerate(sources) if name in src]
            if not owners:
                raise ValueError(f"{name}: the source model has no such parameter")
            owners.sort(key=lambda r: r != dst)  # a slice on this rank first: no traffic
            todo = torch.zeros(d_shape, dtype=torch.bool)  # destination elements still to fill: those
            todo[inside(d_off, d_shape, sources[owners[0]][name][2])] = True  # not padding rows of another TP
            for r in owners:
                s_off, s_shape, _ = sources[r][name]
                where = overlap(d_off, d_shape, s_off, s_shape)
                if where is None:
                    continue
                src_slices, dst_slices = where
                if not todo[dst_slices].any():  # a replica of what an earlier slice gave
                    continue
                todo[dst_slices] = False
                moves.append(Move(name, r, dst, src_slices, dst_slices, int(todo[dst_slices].numel())))
            if todo.any():
                raise ValueError(f"{name}: no source slice covers every element of rank {dst}'s slice")
    return moves


def planned_bytes(moves: list[Move], itemsize: int) -> int:
    """Bytes that cross between ranks (moves within a rank are copies)."""
    return sum(m.numel * itemsize for m in moves if m.src != m.dst)


@torch.no_grad()
def sync_weights(source: nn.Module, destination: nn.Module) -> int:
    """Copy `source`'s parameters into `destination`'s (the same model in another layout, same ranks);
    every rank calls it (one process without a process group too). Returns the bytes this rank sent.
    A ZeRO-3 engine's weights exist only while gathered: call it inside `Engine.whole_weights()`."""
    if buffers_saved(source):
        raise NotImplementedYet(f"weight sync of a model with buffers ({next(iter(buffers_saved(source)))}: the MoE "
                                "expert bias); the inference copy would route without it")
    freed = next((name for module in (source, destination) for name, p in module.named_parameters()
                  if p.numel() and p.untyped_storage().size() == 0), None)
    if freed is not None:
        raise ValueError(f"weight sync: parameter {freed} holds no weights (a ZeRO-3 engine frees them between "
                         "uses): call sync_weights inside `with engine.whole_weights():` (writes=True for a "
                         "destination engine)")
    distributed = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    dtypes = {p.dtype for p in source.parameters()} | {p.dtype for p in destination.parameters()}
    if len(dtypes) > 1:
        raise ValueError(f"weight sync copies like for like; the copies hold {sorted(map(str, dtypes))}")
    mine = (_placements(source), _placements(destination))
    every: list = [mine] * world
    if distributed:
        dist.all_gather_object(every, mine)
    moves = plan([e[0] for e in every], [e[1] for e in every])
    src_params, dst_params = dict(source.named_parameters()), dict(destination.named_parameters())
    works, receives, sent = [], [], 0
    for m in moves:
        if m.src == rank and m.dst == rank:
            dst_params[m.name][m.dst_slices].copy_(src_params[m.name][m.src_slices])
        elif m.src == rank:
            block = src_params[m.name][m.src_slices].contiguous()
            works.append(dist.isend(block, m.dst))
            receives.append((None, None, block))  # keep the buffer alive until waited
            sent += block.nbytes
            traffic.record("send", "weight-sync", "world", block.nbytes)
        elif m.dst == rank:
            buf = torch.empty(tuple(s.stop - s.start for s in m.dst_slices), dtype=dst_params[m.name].dtype)
            works.append(dist.irecv(buf, m.src))
            receives.append((m.name, m.dst_slices, buf))
    for w in works:
        w.wait()
    for name, slices, buf in receives:
        if name is not None:
            dst_params[name][slices].copy_(buf)
    return sent


__all__ = ["Move", "plan", "planned_bytes", "sync_weights"]
