"""Text reports of layouts: sizes, a rank -> coordinates table and the groups (for validate / layout).

A report costs what it prints, whatever the world size: groups are read by arithmetic
(`Topology.member`), the first MAX_GROUPS of each kind and the first MAX_MEMBERS ranks of each, and
a rank table shows MAX_ROWS rows unless every rank is asked for (up to MAX_ALL_RANKS).
"""
from __future__ import annotations

from collections.abc import Sequence

from fivefold.errors import UserError
from fivefold.topology import Layout, Topology

MAX_ROWS = 64
MAX_GROUPS = 8
MAX_MEMBERS = 16
MAX_ALL_RANKS = 1 << 16


def _preview(topo: Topology, dims: str, embedding: bool, ranks: Sequence[int] | None) -> str:
    n = topo.num_groups(dims)
    shown = [_group_cells(topo, k, dims, embedding, ranks) for k in range(min(n, MAX_GROUPS))]
    return " ".join(shown) + (f" ... ({n} groups)" if n > MAX_GROUPS else "")


def _group_cells(topo: Topology, k: int, dims: str, embedding: bool, ranks: Sequence[int] | None = None) -> str:
    """Group k over `dims` as `[0,1,...]`, by arithmetic (`Topology.member`): its first MAX_MEMBERS ranks
    and its size, or an embedding group's first and last (`ranks`: global GPU of each local rank)."""
    size = topo.group_size(dims)
    js = sorted({0, size - 1}) if embedding else range(min(size, MAX_MEMBERS))
    cells = [str(ranks[r] if ranks is not None else r) for r in (topo.member(k, j, dims) for j in js)]
    if not embedding and size > MAX_MEMBERS:
        cells.append(f"...{size} ranks")
    return "[" + ",".join(cells) + "]"


def _listed_groups(lay: Layout) -> list[tuple[str, Topology, str]]:
    """(name, grid, dims) of the groups a report lists: the expert ones only under EP."""
    return [(name, topo, dims) for name, (topo, dims) in lay.group_specs().items()
            if not (name.startswith("e") and name != "embedding" and lay.ep == 1)]


def _coords(lay: Layout, rank: int) -> dict[str, int]:
    """A rank's dense coordinates, and its expert ones under EP."""
    return dict(lay.dense.coords(rank)) | (dict(lay.expert.coords(rank)) if lay.ep > 1 else {})


def sizes_line(lay: Layout) -> str:
    line = f"TP={lay.tp} CP={lay.cp} PP={lay.pp} DP={lay.dp}"
    if lay.ep > 1:
        line += f" | experts: ETP={lay.etp} EP={lay.ep} EDP={lay.edp}"
    return line + f" | world={lay.world_size} order={lay.order}"


def rank_table(lay: Layout, ranks: Sequence[int] | None = None, all_ranks: bool = False) -> list[str]:
    """One line per rank: global rank, local rank (if `ranks` maps them) and coordinates."""
    if all_ranks and lay.world_size > MAX_ALL_RANKS:
        raise UserError(f"--all-ranks prints one line per rank: {lay.world_size} ranks is more than the "
                        f"{MAX_ALL_RANKS} it prints (drop --all-ranks: the first and last ranks are shown)")
    moe = lay.ep > 1
    dims = [d for d in lay.dense.dims] + (["etp", "ep", "edp"] if moe else [])
    head = ("gpu  local  " if ranks else "rank  ") + "  ".join(f"{d:>3}" for d in dims)
    out = [head]
    n = lay.world_size
    rows = range(n) if all_ranks or n <= MAX_ROWS else list(range(MAX_ROWS // 2)) + list(range(n - 4, n))
    last = -1
    for r in rows:
        if r != last + 1:
            out.append("  ...")
        last = r
        c = _coords(lay, r)
        cells = "  ".join(f"{c[d]:>3}" for d in dims)
        out.append(f"{ranks[r]:>3}  {r:>5}  {cells}" if ranks else f"{r:>4}  {cells}")
    return out


def rank_report(lay: Layout, rank: int) -> str:
    """One rank of a layout (`layout --rank R`): its coordinates and the group of each kind it is in
    (an embedding group: the first and last rank of its pipeline, where it is one of them)."""
    if not 0 <= rank < lay.world_size:
        raise UserError(f"--rank {rank} is outside the {lay.world_size} ranks")
    out = [sizes_line(lay), f"rank {rank}: " + " ".join(f"{d}={v}" for d, v in _coords(lay, rank).items()),
           "its groups:"]
    for name, topo, dims in _listed_groups(lay):
        k, last = topo.group_index(rank, dims), topo.group_size(dims) - 1  # (never builds a huge group)
        if name == "embedding" and rank not in (topo.member(k, 0, dims), topo.member(k, last, dims)):
            continue
        out.append(f"  {name:<15} {_group_cells(topo, k, dims, name == 'embedding')}")
    return "\n".join(out)


def groups_lines(lay: Layout, ranks: Sequence[int] | None = None) -> list[str]:
    out = []
    for name, topo, dims in _listed_groups(lay):
        out.append(f"  {name:<15} {_preview(topo, dims, name == 'embedding', ranks or None)}")
    return out


def layout_report(lay: Layout, ranks: Sequence[int] | None = None, all_ranks: bool = False) -> str:
    return "\n".join([sizes_line(lay), *rank_table(lay, ranks, all_ranks), "groups:",
                      *groups_lines(lay, ranks)])


def gpu_ranges(ranks: Sequence[int]) -> str:
    """'4-7' for consecutive GPUs, else '0,2,4' (the first 16 and a count when there are more)."""
    if len(ranks) > 1 and list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks[:16])) + (f",... ({len(ranks)} GPUs)" if len(ranks) > 16 else "")
