"""`fivefold schedule`: build (or load), verify, simulate and draw a pipeline schedule."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from fivefold.cli._outputs import picture_file, writing
from fivefold.cli._planner_args import positive_int
from fivefold.errors import UserError
from fivefold.pipeline.csvio import MAX_PASSES, load_csv, replaceable, save_csv
from fivefold.pipeline.ir import Kind
from fivefold.pipeline.lowering import lower
from fivefold.pipeline.render import draw_png, summary, text_timeline
from fivefold.pipeline.schedules import REGISTRY, build_schedule
from fivefold.pipeline.simulate import Costs, simulate
from fivefold.pipeline.verify import verify

HELP = "print a pipeline schedule's timeline, bubble and peak activations; draw it to PNG"


GENERATED = {"pp": 4, "microbatches": 8, "schedule": "1f1b", "vpp": None, "group": None}
"""What a generated schedule is built from, with the defaults; a loaded one (--load-csv) sets its own."""


MAX_WIDTH = 10_000
"""Characters a text timeline row may take (`--width`): a row is built whole, per rank."""


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (a cost, a latency)."""
    v = float(text)
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"{text}: must be a finite number >= 0")
    return v


def _width(text: str) -> int:
    """argparse type: a whole number of characters, 1 to MAX_WIDTH."""
    v = int(text)
    if not 1 <= v <= MAX_WIDTH:
        raise argparse.ArgumentTypeError(f"{text}: must be a whole number of characters from 1 to {MAX_WIDTH:,} "
                                         "(default 160)")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pp", type=positive_int, default=None, help=f"pipeline ranks (default {GENERATED['pp']})")
    p.add_argument("--microbatches", type=positive_int, default=None,
                   help=f"microbatches per step (default {GENERATED['microbatches']})")
    p.add_argument("--schedule", choices=REGISTRY, default=None, help=f"generator (default {GENERATED['schedule']})")
    p.add_argument("--vpp", type=positive_int, default=None, help="chunks per rank for --schedule interleaved")
    p.add_argument("--group", type=positive_int, default=None, metavar="N",
                   help="--schedule interleaved: microbatches per group (Megatron's microbatch_group_size_per_vp_stage; "
                        "default PP)")
    p.add_argument("--costs", default="1,1,1", metavar="F,B,W",
                   help="forward, input-backward, weight-backward cost of one rank's whole share of "
                        "layers for one microbatch; a rank's k stages each cost 1/k (default 1,1,1)")
    p.add_argument("--fb-cost", type=nonnegative_float, default=None, metavar="X",
                   help="cost of a DualPipeV F&B action for a whole rank share (default F+B+W: no overlap)")
    p.add_argument("--p2p", type=nonnegative_float, default=0.0, help="p2p latency per message (default 0)")
    p.add_argument("--png", metavar="FILE.png", type=picture_file, help="draw the timeline to FILE.png")
    p.add_argument("--csv", metavar="FILE", help="write the schedule (with sends/receives) to FILE")
    p.add_argument("--load-csv", metavar="FILE", help="read a hand-written schedule instead of generating one")
    p.add_argument("--width", type=_width, default=160,
                   help=f"text timeline width in characters, at most {MAX_WIDTH:,} (default 160)")


def _costs(text: str) -> tuple[float, float, float]:
    try:
        f, b, w = (float(x) for x in text.split(","))
    except ValueError:
        raise UserError(f"--costs {text!r}: expected three numbers F,B,W such as 1,1,1") from None
    if not all(c >= 0 and math.isfinite(c) for c in (f, b, w)):
        raise UserError(f"--costs {text!r}: each cost must be a finite number >= 0 (such as 1,1,1)")
    if f + b + w == 0:
        raise UserError(f"--costs {text!r}: all three 0 leaves nothing to time (makespan 0); "
                        "give at least one > 0, such as 1,1,1")
    return f, b, w


def run(args: argparse.Namespace, extra: list[str]) -> int:
    if args.csv and not replaceable(args.csv):
        there = ("a folder" if Path(args.csv).is_dir()
                 else "a file this command did not write (a hand-written schedule?)")
        raise UserError(f"--csv {args.csv}: {there} is there; --csv names a new file to write the schedule to "
                        "(or one it wrote before): give another name, or --load-csv to read a schedule")
    given = [f"--{name}" for name in GENERATED if getattr(args, name) is not None]
    if args.load_csv and given:
        raise UserError(f"{', '.join(given)}: what a generated schedule is built from, but --load-csv reads "
                        f"{args.load_csv}, whose rows set its ranks, stages and microbatches: drop them")
    for name, default in GENERATED.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.group is not None and args.schedule != "interleaved":
        raise UserError(f"--group {args.group}: groups microbatches per virtual stage, which only --schedule "
                        f"interleaved has (this one: {args.schedule}); drop it")
    if args.load_csv:
        schedule = lower(load_csv(args.load_csv))
    else:
        chunks = REGISTRY[args.schedule].chunks(args.vpp)
        if args.pp * chunks * args.microbatches > MAX_PASSES:
            raise UserError(f"--pp {args.pp} x {chunks} chunks x --microbatches {args.microbatches} = "
                            f"{args.pp * chunks * args.microbatches:,} stage-microbatches: the command simulates and "
                            f"draws at most {MAX_PASSES:,}; give fewer stages or microbatches")
        schedule = build_schedule(args.schedule, args.pp, args.microbatches, args.vpp, args.group)
    verify(schedule)
    if args.fb_cost is not None and not any(a.kind == Kind.FB for acts in schedule.ranks for a in acts):
        raise UserError(f"--fb-cost {args.fb_cost}: the cost of an overlapped F&B action, and this schedule has "
                        "none (DualPipeV's, or F&B cells in a --load-csv schedule): drop it")
    f, b, w = _costs(args.costs)
    result = simulate(schedule, Costs.per_rank(schedule, f, b, w, args.p2p, args.fb_cost))
    if not math.isfinite(result.makespan):  # each cost finite, their sum past the largest float
        given = f"--costs {args.costs}, --p2p {args.p2p:g}" + (
            f", --fb-cost {args.fb_cost:g}" if args.fb_cost is not None else "")
        raise UserError(f"{given}: the makespan overflows a float ({result.makespan}); give smaller numbers "
                        "(only their ratios matter: divide them all by the same factor)")
    print(text_timeline(schedule, result, args.width))
    print(summary(schedule, result))
    if args.csv:
        with writing("--csv", args.csv):
            save_csv(schedule, args.csv)
        print(f"wrote {args.csv}")
    if args.png:
        with writing("--png", args.png):
            draw_png(schedule, result, args.png)
        print(f"wrote {args.png}")
    return 0
