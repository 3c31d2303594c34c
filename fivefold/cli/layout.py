"""`fivefold layout --tp 2 --pp 2 --cp 2 [--ep E --etp T] (--dp N | --world-size N)` or
`fivefold layout ALLOCATION_MODE | MODELS.yaml [--rank R]`: the rank grid, per component."""
from __future__ import annotations

import argparse

from fivefold.config.allocation import Allocation, parse_allocation
from fivefold.config.load import is_file, load_config
from fivefold.config.megatron import FLAGS, VALUE, flags_of
from fivefold.config.report import MAX_ROWS, gpu_ranges, layout_report, rank_report
from fivefold.config.rules import KNOB_FIELDS
from fivefold.config.validate import validate
from fivefold.errors import UserError
from fivefold.topology import Layout, parse_order

HELP = "print the rank grid of a layout, or which GPUs and coordinates each component of an allocation gets"


def megatron_flags(dim: str) -> list[str]:
    """Megatron-LM's value flag for the size `dim` (from the flag table validate reads), [] for DP:
    Megatron derives it."""
    field = KNOB_FIELDS.get(dim)
    return [name for name in flags_of(field) if FLAGS[name].kind == VALUE and not FLAGS[name].ours][:1] if field else []


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?", help="an AReaL allocation mode (sglang.d2t2p1+d1t4p1) or a YAML with models:")
    for dim in ("tp", "pp", "cp", "ep", "etp", "dp"):  # each also under Megatron-LM's name, as validate takes it
        p.add_argument(f"--{dim}", *megatron_flags(dim), type=int, default=None, help=f"{dim.upper()} size")
    p.add_argument("--world-size", type=int, help="total ranks; DP = world / (TP*PP*CP)")
    p.add_argument("--order", default=None, help=f"rank order, fastest first (default {DEFAULT_ORDER})")
    p.add_argument("--rank", type=int, help="show this GPU's coordinates in every component")
    p.add_argument("--all-ranks", action="store_true", help="print every rank")


DEFAULT_ORDER = "tp-cp-ep-dp-pp"
GRID_FLAGS = ("tp", "pp", "cp", "ep", "etp", "dp", "world_size", "order")
"""What describes a grid of sizes (the sizes, then the order); an allocation or a models: YAML carries
its own."""


def grid_layout(args) -> Layout:
    for dim in GRID_FLAGS[:-1]:  # the sizes
        v = getattr(args, dim)
        if v is not None and v < 1:
            raise UserError(f"--{dim.replace('_', '-')} {v}: must be >= 1 (leave it out for 1)")
    tp, pp, cp, ep = args.tp or 1, args.pp or 1, args.cp or 1, args.ep or 1
    etp = args.etp if args.etp is not None else tp
    if ep == 1 and etp != tp:  # the report draws the experts' grid under EP only: it was dropped unsaid
        raise UserError(f"--etp {etp} with EP=1: the expert grid (ETP x EP x EDP) is printed for EP > 1; give --ep "
                        f"(e.g. --ep 2), or leave --etp out (ETP is TP, {tp})")
    mp = tp * pp * cp
    if args.dp is not None and args.world_size is not None and args.dp * mp != args.world_size:
        raise UserError(f"--dp {args.dp} x TP*PP*CP {mp} != --world-size {args.world_size}")
    if args.world_size is not None and args.world_size % mp:
        raise UserError(f"TP*PP*CP = {mp} must divide --world-size {args.world_size}")
    dp = args.dp if args.dp is not None else (args.world_size // mp if args.world_size else 1)
    order = args.order or DEFAULT_ORDER
    try:
        parse_order(order)
    except ValueError as e:
        raise UserError(str(e)) from None
    if sorted(order.split("-")) != sorted(["tp", "cp", "ep", "dp", "pp"]):
        raise UserError(f"--order {order} must name each of tp, cp, ep, dp, pp once")
    dense = tp * cp * dp
    if dense % (etp * ep):
        fits = [e for e in _divisors(dense // ep) if e <= etp] if dense % ep == 0 else []
        fix = f"try --etp {fits[-1]}" if fits else f"--ep must divide TP*CP*DP = {dense}"
        raise UserError(f"MoE folding: ETP*EP = {etp * ep} must divide TP*CP*DP = {dense} "
                        f"(ETP defaults to TP; {fix})")
    return Layout(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, etp=etp, order=order)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 1 << 16) + 1) if n % d == 0]


def _allocation(spec: str) -> Allocation:
    if is_file(spec):
        loaded = load_config(spec)
        if loaded.allocation is None:
            raise UserError(f"{spec} has neither models: nor allocation_mode; use fivefold validate")
        for c in loaded.allocation.components:
            if c.config is not None:  # a listed model's own layout: refused with its fix when invalid
                validate(c.config, loaded.dialect)
        return loaded.allocation
    return parse_allocation(spec)


def run(args, extra) -> int:
    if args.spec is None:
        lay = grid_layout(args)
        print(layout_report(lay, all_ranks=args.all_ranks) if args.rank is None else rank_report(lay, args.rank))
        return 0
    given = [f"--{name.replace('_', '-')}" for name in GRID_FLAGS if getattr(args, name) is not None]
    if given:
        raise UserError(f"{', '.join(given)}: sizes of a grid, but {args.spec} carries its own (each component's "
                        "or model's layout): drop them, or drop the allocation to see a grid")
    alloc = _allocation(args.spec)
    if args.rank is not None and not 0 <= args.rank < alloc.world_size:
        raise UserError(f"--rank {args.rank} is outside the {alloc.world_size} GPUs")
    print(f"{len(alloc.components)} components on {alloc.world_size} GPUs")
    for c in alloc.components:
        print(f"== {c.name} ({c.role}) on GPUs {gpu_ranges(c.ranks)}")
        print(layout_report(c.layout, c.ranks, args.all_ranks))
    n = alloc.world_size
    shown = [args.rank] if args.rank is not None else (
        range(n) if args.all_ranks or n <= MAX_ROWS else [*range(MAX_ROWS // 2), None, *range(n - 4, n)])
    print("per GPU:")
    for r in shown:
        if r is None:
            print(f"  ... (--rank R for one GPU, --all-ranks for all {n})")
            continue
        parts = [f"{name}: " + " ".join(f"{k}={v}" for k, v in coords.items()) for name, coords in alloc.by_rank(r)]
        print(f"  GPU {r}: " + (" | ".join(parts) if parts else "idle"))
    return 0
