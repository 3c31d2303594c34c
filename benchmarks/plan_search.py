"""Search time of the planner on 1024 H100s: DeepSeek-V3 671B (MoE) and Llama 3 405B (dense); goal
under a second of CPU each, also in the larger space with FSDP beside the distributed optimizer.

    python benchmarks/plan_search.py      # prints one Markdown row per case for benchmarks/RESULTS.md

CPU time (`time.process_time`) is the figure to read on a shared machine: wall time grows with the
other jobs. The first search of each case starts from cold caches, as the first `fivefold plan` in a
process does: it runs in FRESH_RUNS fresh processes (`--first NAME [--dp-modes ...]`), whose median
(and range) the row gives, since one sample on this shared 2-core machine moves by 10% or more from
run to run; the repeats reuse the per-layout caches. The space is the default one (VPP up to layers /
PP; the distributed optimizer), and for the 671B also with FSDP (ZeRO-3) in it (`plan --dp-modes
distopt,fsdp`); the default rows also give, untimed, what the space of VPP <= 4 (the default before
2026-11-24) tries, sizes and fits. "tried" counts every variant (layout x DP mode x micro-batch x
recompute) the search meets, "sized" those whose memory it computed (the rest are dropped by a rule
or a bound without being sized: docs/planner.md), "fit" the ranked ones.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivefold.planner.presets import hardware, model_preset  # noqa: E402
from fivefold.planner.search import clear_caches, search  # noqa: E402
from fivefold.planner.space import SearchSpace  # noqa: E402

FSDP = ("optim", "optim_grads_params")
CASES = (("deepseek-v3", "671B", ("optim",)), ("deepseek-v3", "671B", FSDP), ("llama3-405b", "405B", ("optim",)))
"""(model preset, size, data-parallel modes searched)."""
FRESH_RUNS = 5


def first_search(name: str, dp_modes: tuple[str, ...]) -> float:
    """CPU seconds of the first search of `name` in this process (cold caches)."""
    m, hw = model_preset(name).model, hardware("h100-sxm")
    c0 = time.process_time()
    search(m, hw, 1024, 8, 4096, 4096, space=SearchSpace(dp_modes=dp_modes))
    return time.process_time() - c0


def fresh_first(name: str, dp_modes: tuple[str, ...]) -> list[float]:
    """`first_search` in FRESH_RUNS new processes."""
    return [float(subprocess.run([sys.executable, __file__, "--first", name, "--dp-modes", ",".join(dp_modes)],
                                 capture_output=True, text=True, check=True).stdout) for _ in range(FRESH_RUNS)]


def python_speed(n: int = 20_000_000) -> float:
    """CPU seconds of a loop of `n` integer additions: how fast this machine runs Python, printed beside
    the rows so that sessions on other machines compare (the AVX2-only 2-core AMD EPYC of session 31:
    0.70-0.89 s; the search's CPU time scales with it, its instruction count does not move)."""
    c0, total = time.process_time(), 0
    for i in range(n):
        total += i
    return time.process_time() - c0


def main() -> None:
    print(f"| machine | Python speed | a loop of 20M integer additions: {python_speed():.2f} s CPU |")
    hw = hardware("h100-sxm")
    for name, size, dp_modes in CASES:
        m, space = model_preset(name).model, SearchSpace(dp_modes=dp_modes)
        first = fresh_first(name, dp_modes)
        clear_caches()
        times, cpu = [], []
        for _ in range(3):
            t0, c0 = time.perf_counter(), time.process_time()
            r = search(m, hw, 1024, 8, 4096, 4096, space=space)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        best = r.ranked[0]
        if dp_modes == ("optim",):
            small = search(m, hw, 1024, 8, 4096, 4096, space=SearchSpace(max_vpp=4))
            before = f" (VPP <= 4: {small.tried}, {small.sized}, {len(small.ranked)})"
        else:
            before = f" (DP modes {', '.join(dp_modes)})"
        print(f"| plan search | {name} {size}, 1024 x h100-sxm, seq 4096, gbs 4096 | {r.tried} layouts tried, "
              f"{r.sized} sized, {len(r.ranked)} fit{before} | "
              f"first (cold) {statistics.median(first):.2f} s CPU, median of {FRESH_RUNS} fresh processes "
              f"({min(first):.2f}-{max(first):.2f}; in this one {cpu[0]:.2f} s, {times[0]:.2f} s wall); again: median "
              f"{statistics.median(cpu[1:]):.2f} s CPU ({statistics.median(times[1:]):.2f} s wall) | "
              f"top: {best.label}, {best.estimate.step_time:.2f} s/step, MFU {best.estimate.mfu:.1%} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--first", metavar="NAME", help="print the CPU seconds of one cold search of this model preset "
                                                     "in this process (what the table's first column runs)")
    ap.add_argument("--dp-modes", default="optim", help="with --first: the data-parallel modes searched, "
                                                        "comma-separated (default optim; FSDP: optim,optim_grads_params)")
    args = ap.parse_args()
    if args.first:
        print(first_search(args.first, tuple(args.dp_modes.split(","))))
    else:
        main()
