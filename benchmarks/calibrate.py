"""The planner against published GPU training runs (benchmarks/data/gpu-runs.tsv).

    python benchmarks/calibrate.py            # the table for benchmarks/RESULTS.md
    python benchmarks/calibrate.py --assumed  # and every unstated value taken, per row

For every row not excluded (`fivefold.planner.calibration.EXCLUDED`, with reasons): the planner's
throughput (tokens/s per GPU, of the runtime that ran it) against the published one, the error
est/pub - 1, whether the planner judges the published layout to fit, and its peak memory against the
published figure on the source's basis (reserved GiB or tensor GB, `MEMORY_BASIS`).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivefold.planner.calibration import EXCLUDED, FLOP_COUNTS, cases, flops_per_token, read_runs  # noqa: E402
from fivefold.planner.layout import Plan  # noqa: E402
from fivefold.planner.memory import MemoryAssumptions, peak_memory  # noqa: E402
from fivefold.planner.presets import hardware  # noqa: E402
from fivefold.planner.search import describe  # noqa: E402
from fivefold.planner.steptime import TimeAssumptions, step_time  # noqa: E402

GiB = 2**30


def compare(case, runtime: str | None = None) -> dict:
    """The planner's figures for one case, under `runtime` (default: the case's own)."""
    hw = hardware(case.hardware_name)
    plan = Plan(case.config)
    mem = peak_memory(plan, MemoryAssumptions())
    est = step_time(plan, hw, TimeAssumptions())
    out = {"row": case.run.row, "source": case.run.source, "fits": mem.total <= hw.memory_bytes,
           "memory": mem, "hw": hw, "estimate": est, "published": case.tokens_per_s, "case": case}
    if case.tokens_per_s:
        out["error"] = est.tokens_per_s_per_gpu / case.tokens_per_s - 1
    if case.memory_bytes:
        on_basis = mem.total - mem.reserve if case.memory_basis == "reserved GiB" else \
            mem.total - mem.reserve - mem.overhead
        out["memory_ratio"] = on_basis / case.memory_bytes
    return out


def summary(results: list[dict]) -> str:
    errs = [abs(r["error"]) for r in results if "error" in r]
    fits = sum(r["fits"] for r in results)
    mem = [r["memory_ratio"] for r in results if "memory_ratio" in r]
    return (f"{len(results)} rows judged ({len(EXCLUDED)} excluded); judged to fit: {fits}/{len(results)}; "
            f"throughput |error| median {statistics.median(errs):.1%}, max {max(errs):.1%} over {len(errs)} rows; "
            f"memory est/pub {min(mem):.2f}-{max(mem):.2f} over {len(mem)} rows")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--assumed", action="store_true", help="list the value taken for every unstated field")
    ap.add_argument("--runtime", help="predict every row with this runtime profile instead of its own")
    args = ap.parse_args()
    results = [compare(c, args.runtime) for c in cases()]
    print("| row | source | model | GPUs | layout | runtime | published tok/s/GPU | estimated | error | fits | "
          "memory est / published |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        c, mem = r["case"], r["memory"]
        pub = f"{r['published']:.0f}" if r["published"] else "-"
        err = f"{r['error']:+.0%}" if "error" in r else "-"
        if "memory_ratio" in r:
            memtxt = f"{r['memory_ratio'] * c.memory_bytes / GiB:.1f} / {c.memory_bytes / GiB:.1f} GiB ({c.memory_basis})"
        else:
            memtxt = f"{mem.total / GiB:.1f} GiB est. (none published)"
        fits = "yes" if r["fits"] else f"no ({mem.total / GiB:.0f} > {r['hw'].memory_bytes / GiB:.0f} GiB)"
        print(f"| {c.run.row} | {c.run.source} | {c.model_name} | {c.config.cluster.world_size} x {c.hardware_name} | "
              f"{describe(c.config)} | {args.runtime or c.runtime} | {pub} | {r['estimate'].tokens_per_s_per_gpu:.0f} | "
              f"{err} | {fits} | {memtxt} |")
    print()
    print(summary(results))
    print()
    print("Excluded: " + "; ".join(f"row {k}: {v}" for k, v in EXCLUDED.items()))
    both = [(r, c) for r in read_runs() for c in [r] if r.num("tokens_per_s_per_gpu") and r.num("tflops_per_gpu")]
    if both:
        from fivefold.planner.calibration import case_of
        checks = []
        for run, _ in both:
            case = case_of(run)
            per_token = run.num("tflops_per_gpu") * 1e12 / run.num("tokens_per_s_per_gpu")
            ours = flops_per_token(case.config.model, case.config.training.seq_length, FLOP_COUNTS[run.source])
            checks.append(f"{run.row}: {per_token / ours:.3f}")
        print("FLOP count check (source TFLOP/s / tokens/s over our count, 1.000 = same convention): "
              + ", ".join(checks))
    if args.assumed:
        print()
        for r in results:
            print(f"row {r['row']}: " + ("; ".join(r["case"].assumed) or "nothing assumed"))


if __name__ == "__main__":
    main()
