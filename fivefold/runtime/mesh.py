"""Process groups of one model's layout, built from a pure `fivefold.topology.Layout`.

A `Mesh` is this process's view of a layout: for every group name of `Layout.named_groups()` (plus
"world") the one group this rank belongs to. It is an object passed to whoever communicates; there is
no module-level "current group". Several meshes (an RL actor and its reference model, say) coexist:
ProcessGroups are cached per process by their rank tuple, so meshes over the same ranks share them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fivefold.errors import UserError
from fivefold.topology import Layout, split_group


def resolve_device(requested: str, local_ranks: int, gpus: int | None = None) -> tuple[str, str | None]:
    """"cuda" or "cpu" for `local_ranks` ranks on one node with `gpus` CUDA devices (None: those this
    process sees), and a notice where `auto` falls back to the CPU although there are GPUs. Each rank
    needs a GPU of its own (NCCL refuses two ranks on one device); `cuda` without enough is a UserError."""
    if gpus is None:
        gpus = torch.cuda.device_count()
    if requested == "cpu" or (requested == "auto" and gpus == 0):
        return "cpu", None
    if gpus >= local_ranks:
        return "cuda", None
    ranks = f"{local_ranks} ranks on this node but {gpus} CUDA device{'s' if gpus != 1 else ''}"
    if requested == "cuda" and gpus == 0:
        raise UserError(f"cluster.device=cuda: torch {torch.__version__} sees no CUDA device here: set "
                        "cluster.device: cpu (or auto), or run where a GPU and a CUDA build of torch are")
    if requested == "cuda":
        raise UserError(f"cluster.device=cuda: {ranks} (one GPU per rank): start at most {gpus} ranks per node "
                        "(--nproc, torchrun --nproc-per-node) or set cluster.device: cpu")
    return "cpu", (f"note: {ranks}: the ranks run on the CPU (gloo). For the GPUs start at most {gpus} ranks per "
                   "node; cluster.device: cuda makes this an error, cluster.device: cpu silences it")


def default_device() -> torch.device:
    """This process's GPU where the job's process group can move tensors there (NCCL, or no group: one
    process), else the CPU: gloo ranks on a machine with GPUs (a test's workers) keep their tensors on
    the CPU (gloo's send of a CUDA tensor failed: "writev ... Bad address", on an H100)."""
    on_gpu = torch.cuda.is_available() and (not dist.is_initialized() or "nccl" in str(dist.get_backend()))
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")


def init_distributed(timeout: timedelta = timedelta(minutes=5), device: str = "auto") -> tuple[int, int, torch.device]:
    """Join the job described by the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) on `device` (`resolve_device`): NCCL on CUDA (with gloo
    for CPU tensors), else gloo with one intra-op thread per rank (several ranks share the CPU cores;
    default threading oversubscribes them ~20x). Returns (rank, world_size, device)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    kind, _ = resolve_device(device, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if kind == "cuda":
        # NCCL for tensors on the GPU; gloo beside it for the small CPU bookkeeping tensors (loss
        # sums, grad-norm squares, peak memory), which NCCL cannot reduce.
        where, backend = torch.device("cuda", local_rank), "cuda:nccl,cpu:gloo"
        torch.cuda.set_device(where)
    else:
        where, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    return rank, world, where


@dataclass(frozen=True)
class Group:
    """A named group of global ranks; `ranks[i]` is the global rank of group rank i.

    `pg` is None when the group has one rank: every collective over it is then the identity."""

    name: str
    ranks: tuple[int, ...]
    pg: ProcessGroup | None
    me: int = field(default=0, compare=False)
    """This process's global rank (a member of `ranks`)."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's index in `ranks`."""
        return self.ranks.index(self.me)

    def global_rank(self, i: int) -> int:
        return self.ranks[i]

    def __repr__(self) -> str:
        return f"Group({self.name!r}, ranks={self.ranks})"


_PG_CACHE: dict[tuple[int, ...], ProcessGroup] = {}
_PG_CACHE_WORLD: list[object] = [None]  # the default group the cache was built under


OWN_COMMUNICATOR = {"edp-grad": "edp"}
"""Groups over another group's ranks with a communicator of their own. Expert gradients are reduced
over EDP during backward, launched by each MoE layer, while the dense buckets are reduced over DP x CP
as they complete; EDP may be the very ranks of DP x CP (TP2 x DP2 with EP2 = TP: EDP = DP), and two
collectives on one communicator must be issued in the same order on every rank. On a communicator of
its own, the order between the two streams does not matter (fivefold.parallel.data.data_parallel)."""


def _process_group(ranks: tuple[int, ...], own: str | None = None) -> ProcessGroup:
    """The cached ProcessGroup over `ranks` (`own`: the one of that name, see OWN_COMMUNICATOR),
    created (collectively) on first use.
    A cache keyed by rank tuple, not a current group: it is dropped when the default group changes."""
    if _PG_CACHE_WORLD[0] is not dist.group.WORLD:
        _PG_CACHE.clear()
        _PG_CACHE_WORLD[0] = dist.group.WORLD
    key = ranks if own is None else (own, *ranks)
    if key not in _PG_CACHE:
        if own is None and ranks == tuple(range(dist.get_world_size())):
            _PG_CACHE[key] = dist.group.WORLD
        else:
            _PG_CACHE[key] = dist.new_group(list(ranks))
    return _PG_CACHE[key]


class Mesh:
    """One model's layout on this process: a Layout plus this rank's group of every name."""

    def __init__(self, layout: Layout, rank: int, device: torch.device, groups: dict[str, Group]):
        self.layout, self.rank, self.device = layout, rank, device
        self._groups = groups

    @classmethod
    def build(cls, layout: Layout, *, device: torch.device | None = None) -> Mesh:
        """Collective: every rank of the world calls it with the same layout, in the same order.
        Every rank creates every multi-rank group of every name, in the same order (torch requires
        all ranks to take part in each `new_group`), and keeps the ones it belongs to.

        Without an initialised process group a one-rank layout still builds (all groups size 1)."""
        if dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            rank, world = 0, 1
        if layout.world_size != world:
            raise ValueError(f"layout {layout} needs {layout.world_size} ranks, the world has {world}")
        if device is None:
            device = default_device()
        named = dict(layout.named_groups())
        named["world"] = [list(range(world))]
        named.update({name: named[of] for name, of in OWN_COMMUNICATOR.items()})
        groups: dict[str, Group] = {}
        for name, lists in named.items():
            for ranks in lists:
                key = tuple(ranks)
                pg = _process_group(key, name if name in OWN_COMMUNICATOR else None) if len(key) > 1 else None
                if rank in key:
                    groups[name] = Group(name, key, pg, me=rank)
        return cls(layout, rank, device, groups)

    def split(self, name: str, parts: int) -> tuple[Group, Group]:
        """Collective: group `name` of every rank cut into `parts` consecutive pieces. Returns this
        rank's piece (the "shard" group, size n/parts) and the group of the ranks at its place in every
        piece (the "replicate" group, size parts): HSDP's two groups. Every rank creates every
        piece of every group of that name, in the same order (torch's new_group rule)."""
        mine = {}
        for ranks in self.layout.named_groups()[name]:
            for kind, lists in zip(("shard", "replicate"), split_group(ranks, parts)):
                for piece in lists:
                    key = tuple(piece)
                    pg = _process_group(key) if len(key) > 1 else None
                    if self.rank in key:
                        mine[kind] = Group(f"{name}-{kind}", key, pg, me=self.rank)
        return mine["shard"], mine["replicate"]

    def group(self, name: str) -> Group:
        try:
            return self._groups[name]
        except KeyError:
            raise KeyError(f"no group {name!r}; the mesh has {sorted(self._groups)}") from None

    @property
    def coords(self) -> dict[str, int]:
        """This rank's {"tp", "cp", "dp", "pp"} coordinates in the dense grid."""
        return self.layout.dense.coords(self.rank)

    tp = property(lambda self: self.group("tp"))
    cp = property(lambda self: self.group("cp"))
    dp = property(lambda self: self.group("dp"))
    pp = property(lambda self: self.group("pp"))
    ep = property(lambda self: self.group("ep"))
    etp = property(lambda self: self.group("etp"))
    edp = property(lambda self: self.group("edp"))
    dp_cp = property(lambda self: self.group("dp-cp"))
    embedding = property(lambda self: self.group("embedding"))
    world = property(lambda self: self.group("world"))

    def __repr__(self) -> str:
        return f"Mesh({self.layout}, rank={self.rank})"
