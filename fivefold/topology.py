"""Ranks <-> coordinates: pure arithmetic, no torch.distributed.

A `Topology` lays `world_size` ranks out on named dimensions in an order string, fastest-varying
first, as Megatron's RankGenerator does: with order "tp-cp-dp-pp", ranks 0..tp-1 form the first TP
group and the PP coordinate changes slowest. A group over a set of dimensions is the ranks that share
every other coordinate.

A `Layout` holds the two grids of Megatron's MoE folding over the same ranks:
  dense  : tp x cp x dp x pp          (attention, dense MLPs, embeddings)
  expert : etp x ep x edp x pp        (routed experts), with etp*ep*edp = tp*cp*dp
Both keep PP outermost in the default order, so their PP groups are identical.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from math import prod

import numpy as np


def parse_order(order: str) -> list[str]:
    dims = [d.strip() for d in order.split("-") if d.strip()]
    if len(set(dims)) != len(dims):
        raise ValueError(f"order={order!r} names a dimension twice")
    return dims


def split_group(ranks: list[int], parts: int) -> tuple[list[list[int]], list[list[int]]]:
    """HSDP's two kinds of group from one group's `ranks` (in coordinate order): `parts` consecutive
    pieces (the "shard" groups, len / parts ranks each) and the ranks at one place in every piece (the
    "replicate" groups, `parts` ranks each)."""
    size = len(ranks) // parts
    return [ranks[i * size: (i + 1) * size] for i in range(parts)], [ranks[j::size] for j in range(size)]


class Topology:
    """`sizes` maps dimension name -> size; `order` lists the dimensions, fastest-varying first."""

    def __init__(self, sizes: dict[str, int], order: str | list[str]):
        dims = parse_order(order) if isinstance(order, str) else list(order)
        missing = set(sizes) - set(dims)
        if missing:
            raise ValueError(f"dimensions {sorted(missing)} are not in order {'-'.join(dims)}")
        self.dims = dims
        self.sizes = {d: int(sizes.get(d, 1)) for d in dims}
        self.world_size = prod(self.sizes.values())
        self.strides = {}
        stride = 1
        for d in dims:
            self.strides[d] = stride
            stride *= self.sizes[d]

    def __repr__(self) -> str:
        return "Topology(" + ", ".join(f"{d}={self.sizes[d]}" for d in self.dims) + ")"

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        return {d: (rank // self.strides[d]) % self.sizes[d] for d in self.dims}

    def rank(self, **coords: int) -> int:
        return sum(coords.get(d, 0) * self.strides[d] for d in self.dims)

    @cached_property
    def _grid(self) -> np.ndarray:
        # Axis i of the grid is dims[-1 - i]: the last axis varies fastest, like rank numbering.
        return np.arange(self.world_size).reshape([self.sizes[d] for d in reversed(self.dims)])

    def groups(self, dims: str | list[str]) -> list[list[int]]:
        """All groups over `dims` ("tp", "dp-cp", ...): each a list of ranks in coordinate order."""
        names = self._names(dims)
        axes = {d: len(self.dims) - 1 - i for i, d in enumerate(self.dims)}
        inner = [axes[d] for d in reversed(self.dims) if d in names]  # keeps the first-in-order fastest
        outer = [a for a in range(len(self.dims)) if a not in inner]
        arr = self._grid.transpose(outer + inner).reshape(-1, prod(self.sizes[d] for d in names))
        return arr.tolist()

    def num_groups(self, dims: str | list[str]) -> int:
        """How many groups over `dims` there are (world size / group size), without building them."""
        return self.world_size // self.group_size(dims)

    def group_size(self, dims: str | list[str]) -> int:
        return prod(self.sizes[d] for d in self._names(dims))

    def member(self, k: int, j: int, dims: str | list[str]) -> int:
        """Rank j of group k over `dims`, in the order of `groups(dims)`, by arithmetic alone: groups
        come in order of their first rank and list their ranks in ascending order, so k and j are
        mixed-radix numbers over the other dims and over `dims`, fastest dim as lowest digit. A
        report of a huge world reads the first few groups this way and never builds the grid."""
        names = self._names(dims)
        return (self._mixed(k, [d for d in self.dims if d not in names])
                + self._mixed(j, [d for d in self.dims if d in names]))

    def group_index(self, rank: int, dims: str | list[str]) -> int:
        """k of the group over `dims` that holds `rank` (`member(k, j, dims)` lists it), by arithmetic."""
        names, c = self._names(dims), self.coords(rank)
        k, scale = 0, 1
        for d in self.dims:
            if d not in names:
                k, scale = k + c[d] * scale, scale * self.sizes[d]
        return k

    def _mixed(self, index: int, dims: list[str]) -> int:
        rank = 0
        for d in dims:
            index, digit = divmod(index, self.sizes[d])
            rank += digit * self.strides[d]
        return rank

    def _names(self, dims: str | list[str]) -> list[str]:
        names = parse_order(dims) if isinstance(dims, str) else list(dims)
        unknown = [d for d in names if d not in self.sizes]
        if unknown:
            raise ValueError(f"unknown dimension(s) {unknown}; this topology has {self.dims}")
        return names

    def group(self, rank: int, dims: str | list[str]) -> list[int]:
        """The group over `dims` that holds `rank`."""
        c = self.coords(rank)
        names = parse_order(dims) if isinstance(dims, str) else list(dims)
        fixed = {d: v for d, v in c.items() if d not in names}
        ranks = [self.rank(**fixed)]
        for d in self.dims:
            if d in names:
                ranks = [r + i * self.strides[d] for i in range(self.sizes[d]) for r in ranks]
        return sorted(ranks)


def dense_grid(tp: int, cp: int, dp: int, pp: int, order: str) -> Topology:
    """A `Layout`'s dense grid: tp x cp x dp x pp in `order` (EP left out)."""
    return Topology({"tp": tp, "cp": cp, "dp": dp, "pp": pp}, [d for d in parse_order(order) if d != "ep"])


def expert_grid(etp: int, ep: int, edp: int, pp: int, order: str) -> Topology:
    """A `Layout`'s expert grid, Megatron's expert generator: the same order with tp -> etp, cp -> 1,
    dp -> edp."""
    rename = {"tp": "etp", "dp": "edp"}
    dims = [rename.get(d, d) for d in parse_order(order) if d != "cp"]
    return Topology({"etp": etp, "ep": ep, "edp": edp, "pp": pp}, dims)


@dataclass(frozen=True)
class Layout:
    """The dense and expert grids of one model over the same ranks (Megatron's MoE folding)."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1
    order: str = "tp-cp-ep-dp-pp"
    cp_a2a: int = 1
    """Context parallelism: how many consecutive CP ranks exchange heads by all-to-all (cp_comm_type
    p2p: 1, a2a: CP, a2a+p2p: hierarchical_context_parallel_sizes[0]); the ring runs across them."""
    cp_gather: bool = False
    """Context parallelism gathers K and V from the whole CP group instead of passing them round the
    ring (cp_comm_type allgather; cp_a2a 1): fivefold/parallel/context/allgather_attention.py."""

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        """Expert data parallel size: (tp*cp*dp) / (etp*ep)."""
        return (self.tp * self.cp * self.dp) // (self.etp * self.ep)

    @cached_property
    def dense(self) -> Topology:
        return dense_grid(self.tp, self.cp, self.dp, self.pp, self.order)

    @cached_property
    def expert(self) -> Topology:
        return expert_grid(self.etp, self.ep, self.edp, self.pp, self.order)

    @cached_property
    def _cp_split(self) -> Topology:
        """The dense grid with cp cut into cp-a2a (fastest, cp_a2a ranks) and cp-ring (the rest):
        CP index = ring index * cp_a2a + a2a index."""
        if self.cp % self.cp_a2a:
            raise ValueError(f"cp_a2a={self.cp_a2a} must divide cp={self.cp}")
        dims = []
        for d in parse_order(self.order):
            dims += ["cpa", "cpr"] if d == "cp" else [] if d == "ep" else [d]
        sizes = {"tp": self.tp, "cpa": self.cp_a2a, "cpr": self.cp // self.cp_a2a, "dp": self.dp, "pp": self.pp}
        return Topology(sizes, dims)

    def embedding_groups(self) -> list[list[int]]:
        """First and last PP stage of each pipeline: where tied embeddings live."""
        return [sorted({g[0], g[-1]}) for g in self.dense.groups("pp")]

    def group_specs(self) -> dict[str, tuple[Topology, str]]:
        """Every group a run builds, by Megatron's names: the grid and the dims it spans ("embedding"
        is derived from "pp": the first and last rank of each pipeline group)."""
        d, e, c = self.dense, self.expert, self._cp_split
        return {"tp": (d, "tp"), "cp": (d, "cp"), "cp-a2a": (c, "cpa"), "cp-ring": (c, "cpr"),
                "dp": (d, "dp"), "pp": (d, "pp"), "dp-cp": (d, "cp-dp"), "tp-cp": (d, "tp-cp"),
                "model-parallel": (d, "tp-pp"), "tp-cp-dp": (d, "tp-cp-dp"), "embedding": (d, "pp"),
                "etp": (e, "etp"), "ep": (e, "ep"), "edp": (e, "edp"), "etp-ep": (e, "etp-ep")}

    def named_groups(self) -> dict[str, list[list[int]]]:
        """Every group a run builds, by Megatron's names, as lists of ranks (builds them all)."""
        return {name: self.embedding_groups() if name == "embedding" else topo.groups(dims)
                for name, (topo, dims) in self.group_specs().items()}
