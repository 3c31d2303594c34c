"""Text reports of layouts: sizes, a rank -> coordinates table and the groups (for validate / layout)."""
from __future__ import annotations

from fivefold.topology import Layout

MAX_ROWS = 64
MAX_GROUPS = 8


def _short(groups: list[list[int]]) -> str:
    shown = " ".join(str(g).replace(" ", "") for g in groups[:MAX_GROUPS])
    more = f" ... ({len(groups)} groups)" if len(groups) > MAX_GROUPS else ""
    return shown + more


def sizes_line(lay: Layout) -> str:
    line = f"TP={lay.tp} CP={lay.cp} PP={lay.pp} DP={lay.dp}"
    if lay.ep > 1:
        line += f" | experts: ETP={lay.etp} EP={lay.ep} EDP={lay.edp}"
    return line + f" | world={lay.world_size} order={lay.order}"


def rank_table(lay: Layout, ranks: tuple[int, ...] | None = None, all_ranks: bool = False) -> list[str]:
    """One line per rank: global rank, local rank (if `ranks` maps them) and coordinates."""
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
        c = dict(lay.dense.coords(r))
        if moe:
            c.update(lay.expert.coords(r))
        cells = "  ".join(f"{c[d]:>3}" for d in dims)
        out.append(f"{ranks[r]:>3}  {r:>5}  {cells}" if ranks else f"{r:>4}  {cells}")
    return out


def groups_lines(lay: Layout, ranks: tuple[int, ...] | None = None) -> list[str]:
    out = []
    for name, groups in lay.named_groups().items():
        if name.startswith("e") and name != "embedding" and lay.ep == 1:
            continue
        if ranks:
            groups = [[ranks[r] for r in g] for g in groups]
        out.append(f"  {name:<15} {_short(groups)}")
    return out


def layout_report(lay: Layout, ranks: tuple[int, ...] | None = None, all_ranks: bool = False) -> str:
    return "\n".join([sizes_line(lay), *rank_table(lay, ranks, all_ranks), "groups:",
                      *groups_lines(lay, ranks)])
