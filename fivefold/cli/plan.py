"""`fivefold plan`: every valid layout of a model on a cluster, ranked by estimated step time."""
from __future__ import annotations

import argparse
import collections
import time

from fivefold.cli._outputs import picture_file, writing
from fivefold.cli._planner_args import SEQ, add_hardware_arguments, assumptions_of, hardware_of, positive_int
from fivefold.config.schema import FP8_RECIPES
from fivefold.errors import UserError
from fivefold.pipeline.schedules import REGISTRY
from fivefold.planner.search.compare import DP_MODES, candidates
from fivefold.planner.report.emit import FORMATS, emit
from fivefold.planner.presets.model_spec import resolve_model
from fivefold.planner.memory.params import count_params
from fivefold.planner.report.tables import Assumed, compare_report, explain, seed_memory_example, table
from fivefold.planner.calibration.runtime import profile
from fivefold.planner.search.configs import describe, make_config
from fivefold.planner.search.ranking import search
from fivefold.planner.search.validity import config_errors

HELP = "rank every valid parallel layout of a model on a cluster by estimated step time"


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="preset name, a Hugging Face config.json, or a fivefold YAML")
    p.add_argument("--gpus", type=positive_int, required=True, help="total GPUs")
    # (each also under Megatron-LM's name, as `estimate` and `train` take it)
    p.add_argument("--seq-len", "--seq-length", type=positive_int, default=SEQ,
                   help=f"tokens per sequence. Default {SEQ}")
    p.add_argument("--global-batch", "--global-batch-size", type=positive_int, default=1024,
                   help="sequences per step. Default 1024")
    p.add_argument("--micro-batch", "--micro-batch-size", default="1,2,4",
                   help="micro-batch sizes to try, comma-separated. Default 1,2,4")
    p.add_argument("--no-accumulation", action="store_true",
                   help="no gradient accumulation: without PP each DP rank takes its whole share of the global batch "
                        "as one micro-batch (torchtitan before June 2025, or a run whose global batch is its local "
                        "batch x DP)")
    p.add_argument("--dp-modes", metavar="MODES",
                   help="data-parallel modes to try, comma-separated, from distopt (zero1), zero2, fsdp (zero3); a "
                        "more sharded mode is ranked only where a less sharded one does not fit. Default: the "
                        "runtime's (distopt; fsdp for torchtitan)")
    p.add_argument("--schedules", default="1f1b,interleaved",
                   help="pipeline schedules to try, comma-separated, from gpipe,1f1b,interleaved,zb-h1,dualpipev. "
                        "Default 1f1b,interleaved")
    p.add_argument("--precision", choices=("bf16", "fp8"), default="bf16", help="GEMM precision. Default bf16")
    p.add_argument("--fp8-recipe", choices=FP8_RECIPES, default=None,
                   help="fp8 scaling with --precision fp8 (Megatron's --fp8-recipe; mxfp8 needs a Blackwell GPU). "
                        "Default delayed")
    p.add_argument("--top", type=positive_int, default=10, help="rows of the ranked table. Default 10")
    p.add_argument("--explain", action="store_true", help="why the top choice, and the seeds' rules beside it")
    p.add_argument("--emit", choices=FORMATS, help="print the top layout in this dialect")
    p.add_argument("--plot", metavar="FILE.png", type=picture_file, help="stacked memory bars of the top layouts")
    p.add_argument("--compare", action="append", default=[], metavar="LAYOUT",
                   help='a layout to place beside the ranking and explain, e.g. "TP4 PP8 VPP5" (repeatable; '
                        "grammar in docs/planner.md)")
    add_hardware_arguments(p)


MAX_PLAN_GPUS = 1 << 20
"""Larger than any cluster built; a search of 2^24 GPUs takes seconds and finds no layout."""


def run(args, extra) -> int:
    if args.fp8_recipe is not None and args.precision != "fp8":  # it would change nothing, silently
        raise UserError(f"--fp8-recipe {args.fp8_recipe}: the scaling of fp8 GEMMs, and --precision is "
                        f"{args.precision}: give --precision fp8 too, or drop it")
    args.fp8_recipe = args.fp8_recipe or "delayed"
    spec = resolve_model(args.model)
    broken = [e for e in config_errors(make_config(spec.model, 1, 1, args.seq_len, 1, "bf16", {}))
              if e.startswith("model.")]  # the model's own rules, on one GPU (else each layout said it)
    if broken:
        raise UserError(f"--model {args.model}: " + "; ".join(broken))
    hw = hardware_of(args)
    gpn = args.gpus_per_node or hw.gpus_per_node
    mem, ta = assumptions_of(args)
    if args.gpus > MAX_PLAN_GPUS:  # the search enumerates the divisors of the GPU count
        raise UserError(f"--gpus={args.gpus}: the planner searches clusters of up to {MAX_PLAN_GPUS:,} GPUs")
    if args.gpus < 1 or args.gpus % gpn and args.gpus > gpn:
        raise UserError(f"--gpus={args.gpus} is not a whole number of {gpn}-GPU nodes")
    try:
        mbs = tuple(positive_int(x) for x in args.micro_batch.split(","))
    except (ValueError, argparse.ArgumentTypeError):
        raise UserError(f"--micro-batch={args.micro_batch!r}: expected comma-separated whole numbers >= 1") from None
    schedules = tuple(x.strip() for x in args.schedules.split(","))
    unknown = [x for x in schedules if x not in REGISTRY]
    if unknown:
        raise UserError(f"--schedules: unknown {', '.join(unknown)}; choose from {','.join(REGISTRY)}")
    rt = profile(args.runtime)
    dp_modes = rt.dp_modes
    if args.dp_modes is not None:
        words = [x.strip().lower() for x in args.dp_modes.split(",")]
        unknown = [w or "''" for w in words if w not in DP_MODES]
        if unknown:
            raise UserError(f"--dp-modes: unknown {', '.join(unknown)}; "
                            "choose from distopt (zero1), zero2, fsdp (zero3)")
        dp_modes = tuple(dict.fromkeys(DP_MODES[w] for w in words))
    if not args.no_accumulation and all(args.global_batch % m for m in mbs):
        step = max(mbs) * args.gpus  # a multiple of it splits over any DP of the GPUs at the largest micro-batch
        near = max(step, round(args.global_batch / step) * step)
        raise UserError(f"--global-batch {args.global_batch} is not a multiple of any micro-batch tried ("
                        f"{','.join(map(str, mbs))}), so no layout splits it into micro-batches x DP: give "
                        f"--global-batch {near} (a multiple of {max(mbs)} x {args.gpus} GPUs), or --micro-batch "
                        "sizes that divide it")
    counts = count_params(spec.model)
    t0 = time.perf_counter()
    bf16_grads = rt.grad_reduce_in_bf16
    space = rt.space(micro_batch_sizes=mbs, accumulate=not args.no_accumulation, schedules=schedules, dp_modes=dp_modes,
                     fp8_recipe=args.fp8_recipe)
    compared = [(text, candidates(text, spec.model, hw, args.gpus, min(gpn, args.gpus), args.seq_len,
                                  args.global_batch, args.precision, mbs, mem, ta, bf16_grads, rt.dp_modes[0],
                                  space)[0])
                for text in args.compare]  # bad descriptions refused before the search
    result = search(spec.model, hw, args.gpus, min(gpn, args.gpus), args.seq_len, args.global_batch, args.precision,
                    space, mem, ta, grad_reduce_in_bf16=bf16_grads, progress=True)
    elapsed = time.perf_counter() - t0
    name = spec.preset or args.model
    print(f"{name}: {_count(counts.total)} parameters ({_count(counts.active)} active) on {args.gpus} x "
          f"{hw.name}, {gpn} per node; seq {args.seq_len}, global batch {args.global_batch}, {args.precision}"
          + (f", runtime {args.runtime}" if args.runtime != "fivefold" else ""))
    print(f"{result.tried} layouts tried in {elapsed:.2f} s: {len(result.ranked)} fit, {len(result.dropped)} dropped")
    if not result.ranked:
        reasons = collections.Counter(r for _, r in result.dropped)
        detail = "\n".join(f"  {n} x {r}" for r, n in reasons.most_common(5))
        raise UserError(f"no layout of {name} fits {args.gpus} x {hw.name}:\n{detail}\nfix: more GPUs (--gpus), a "
                        "GPU with more memory (--gpu), a shorter --seq-len, or the sharded DP modes "
                        "(--dp-modes distopt,zero2,fsdp)")
    reasons = collections.Counter(r.split(" on pipeline")[0] if r.startswith("needs") else r for _, r in result.dropped)
    print(table(result.ranked, args.top))
    if result.dropped:
        too_big = sum(1 for _, r in result.dropped if r.startswith("needs"))
        parts = [f"{n} x {r}" for r, n in reasons.most_common(4) if not r.startswith("needs")][:3]
        parts += [f"{too_big} do not fit in memory"] if too_big else []
        print("dropped, most common reasons: " + "; ".join(parts))
    best, assume = result.ranked[0], Assumed(mem, ta, bf16_grads, rt.dp_modes[0], space.tp_comm_overlap)
    if args.explain:
        print()
        print(explain(best, spec.model, spec.preset, counts.total, hw, args.gpus, gpn, args.seq_len,
                      args.global_batch, args.precision, result.ranked, assume))
        if spec.preset == "llama3-70b":
            print()
            print(seed_memory_example(spec.model, counts.total, hw))
    for text, cand in compared:
        print()
        print(compare_report(text, cand, best, result.ranked, spec.model, hw, gpn, assume))
    if args.emit:
        print()
        print(emit(best.config, args.emit, name))
    if args.plot:
        from fivefold.planner.report.plot import plot_memory
        with writing("--plot", args.plot):
            plot_memory(result.ranked[:args.top], hw.memory_bytes, args.plot, f"{name} on {args.gpus} x {hw.name}")
        print(f"wrote {args.plot}")
    return 0


def _count(n: float) -> str:
    """A parameter count as people write it: 70.6B, or 10.6M below a billion (a test model was 0.0B)."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


__all__ = ["HELP", "add_arguments", "run", "describe"]
