"""`fivefold layout --tp 2 --pp 2 --cp 2 [--ep E --etp T] (--dp N | --world-size N)` or
`fivefold layout ALLOCATION_MODE | MODELS.yaml [--rank R]`: the rank grid, per component."""
from __future__ import annotations

import argparse
from pathlib import Path

from fivefold.allocation import Allocation, parse_allocation
from fivefold.config.load import load_config
from fivefold.config.report import layout_report
from fivefold.errors import UserError
from fivefold.topology import Layout, parse_order

HELP = "print the rank grid of a layout, or which GPUs and coordinates each component of an allocation gets"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?", help="an AReaL allocation mode (sglang.d2t2p1+d1t4p1) or a YAML with models:")
    for dim in ("tp", "pp", "cp", "ep", "etp", "dp"):
        p.add_argument(f"--{dim}", type=int, default=None, help=f"{dim.upper()} size")
    p.add_argument("--world-size", type=int, help="total ranks; DP = world / (TP*PP*CP)")
    p.add_argument("--order", default="tp-cp-ep-dp-pp", help="rank order, fastest first")
    p.add_argument("--rank", type=int, help="show this GPU's coordinates in every component")
    p.add_argument("--all-ranks", action="store_true", help="print every rank")


def grid_layout(args) -> Layout:
    tp, pp, cp, ep = args.tp or 1, args.pp or 1, args.cp or 1, args.ep or 1
    etp = args.etp if args.etp is not None else tp
    mp = tp * pp * cp
    if args.dp is not None and args.world_size is not None and args.dp * mp != args.world_size:
        raise UserError(f"--dp {args.dp} x TP*PP*CP {mp} != --world-size {args.world_size}")
    if args.world_size is not None and args.world_size % mp:
        raise UserError(f"TP*PP*CP = {mp} must divide --world-size {args.world_size}")
    dp = args.dp if args.dp is not None else (args.world_size // mp if args.world_size else 1)
    try:
        parse_order(args.order)
    except ValueError as e:
        raise UserError(str(e)) from None
    if sorted(args.order.split("-")) != sorted(["tp", "cp", "ep", "dp", "pp"]):
        raise UserError(f"--order {args.order} must name each of tp, cp, ep, dp, pp once")
    if (tp * cp * dp) % (etp * ep):
        raise UserError(f"MoE folding: ETP*EP = {etp * ep} must divide TP*CP*DP = {tp * cp * dp} "
                        "(ETP defaults to TP; try --etp 1)")
    return Layout(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, etp=etp, order=args.order)


def _allocation(spec: str) -> Allocation:
    if Path(spec).is_file():
        loaded = load_config(spec)
        if loaded.allocation is None:
            raise UserError(f"{spec} has neither models: nor allocation_mode; use fivefold validate")
        return loaded.allocation
    return parse_allocation(spec)


def run(args, extra) -> int:
    if args.spec is None:
        print(layout_report(grid_layout(args), all_ranks=args.all_ranks))
        return 0
    alloc = _allocation(args.spec)
    print(f"{len(alloc.components)} components on {alloc.world_size} GPUs")
    for c in alloc.components:
        print(f"== {c.name} ({c.role}) on GPUs {list(c.ranks)}")
        print(layout_report(c.layout, c.ranks, args.all_ranks))
    ranks = [args.rank] if args.rank is not None else range(alloc.world_size)
    print("per GPU:")
    for r in ranks:
        if not 0 <= r < alloc.world_size:
            raise UserError(f"--rank {r} is outside the {alloc.world_size} GPUs")
        parts = [f"{name}: " + " ".join(f"{k}={v}" for k, v in coords.items()) for name, coords in alloc.by_rank(r)]
        print(f"  GPU {r}: " + (" | ".join(parts) if parts else "idle"))
    return 0
