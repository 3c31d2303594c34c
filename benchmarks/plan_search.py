"""Search time of the planner on 1024 H100s: DeepSeek-V3 671B (MoE) and Llama 3 405B (dense); goal
under a second of CPU each, also in the larger space with FSDP beside the distributed optimizer.

    python benchmarks/plan_search.py      # prints one Markdown row per case for benchmarks/RESULTS.md

Each case runs the search as `fivefold plan` does (`plan --model NAME --gpus 1024 --seq-len 4096
--global-batch 4096 [--runtime R] [--dp-modes ...]`): under a runtime profile's memory and time
assumptions and its search space (`runtime.profile`; `fivefold`, plan's default, unless the row names
another). Until 2026-11-28 the rows timed the bare `MemoryAssumptions()` / `TimeAssumptions()`, which no
`plan` uses: our runtime's profile sizes the optimizer's scratch (more ranks) and times attention and
expert GEMMs by size, 1.3x the bare search's CPU.

CPU time (`time.process_time`) is the figure to read on a shared machine: wall time grows with the
other jobs. The first search of each case starts from cold caches, as the first `fivefold plan` in a
process does: it runs in FRESH_RUNS fresh processes (`--first NAME [--runtime R] [--dp-modes ...]`), whose
median (and range) the row gives, since one sample on this shared 2-core machine moves by 10% or more
from run to run; the repeats reuse the per-layout caches. The space is the runtime's (VPP up to layers
/ PP; the distributed optimizer for ours and Megatron's, FSDP for torchtitan's), and for the 671B also
with FSDP (ZeRO-3) beside the distributed optimizer (`plan --dp-modes distopt,fsdp`). "tried" counts
every variant (layout x DP mode x micro-batch x recompute) the search meets, "sized" those whose memory
it computed (the rest are dropped by a rule or a bound without being sized: docs/planner.md), "fit" the
ranked ones.
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
from fivefold.planner.calibration.runtime import profile  # noqa: E402
from fivefold.planner.search.ranking import SearchResult, clear_caches, search  # noqa: E402

FSDP = ("optim", "optim_grads_params")
CASES = (("deepseek-v3", "671B", "fivefold", None), ("deepseek-v3", "671B", "fivefold", FSDP),
         ("deepseek-v3", "671B", "megatron-te", None), ("deepseek-v3", "671B", "torchtitan", None),
         ("llama3-405b", "405B", "fivefold", None))
"""(model preset, size, runtime profile, data-parallel modes searched; None: the runtime's)."""
FRESH_RUNS = 5


def plan_search(name: str, runtime: str, dp_modes: tuple[str, ...] | None, **space) -> SearchResult:
    """The search `fivefold plan --model NAME --gpus 1024 --seq-len 4096 --global-batch 4096 --runtime
    RUNTIME` runs (`dp_modes`: `--dp-modes`; `space`: other fields of its search space)."""
    rt = profile(runtime)
    space = rt.space(**space, **({"dp_modes": dp_modes} if dp_modes else {}))
    return search(model_preset(name).model, hardware("h100-sxm"), 1024, 8, 4096, 4096, "bf16", space, rt.memory,
                  rt.time, grad_reduce_in_bf16=rt.grad_reduce_in_bf16)


def first_search(name: str, runtime: str, dp_modes: tuple[str, ...] | None) -> float:
    """CPU seconds of the first search of `name` in this process (cold caches)."""
    c0 = time.process_time()
    plan_search(name, runtime, dp_modes)
    return time.process_time() - c0


def fresh_first(name: str, runtime: str, dp_modes: tuple[str, ...] | None) -> list[float]:
    """`first_search` in FRESH_RUNS new processes."""
    command = [sys.executable, __file__, "--first", name, "--runtime", runtime] + \
        (["--dp-modes", ",".join(dp_modes)] if dp_modes else [])
    return [float(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
            for _ in range(FRESH_RUNS)]


def python_speed(n: int = 20_000_000) -> float:
    """CPU seconds of a loop of `n` integer additions: how fast this machine runs Python, printed beside
    the rows so that runs on other machines compare (an AVX2-only 2-core AMD EPYC: 0.70-0.89 s; the
    search's CPU time scales with it, its instruction count does not move)."""
    c0, total = time.process_time(), 0
    for i in range(n):
        total += i
    return time.process_time() - c0


def main() -> None:
    print(f"| machine | Python speed | a loop of 20M integer additions: {python_speed():.2f} s CPU |")
    for name, size, runtime, dp_modes in CASES:
        first = fresh_first(name, runtime, dp_modes)
        clear_caches()
        times, cpu = [], []
        for _ in range(3):
            t0, c0 = time.perf_counter(), time.process_time()
            r = plan_search(name, runtime, dp_modes)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        best = r.ranked[0]
        if dp_modes is None:
            small = plan_search(name, runtime, None, max_vpp=4)
            before = f" (VPP <= 4: {small.tried}, {small.sized}, {len(small.ranked)})"
        else:
            before = f" (DP modes {', '.join(dp_modes)})"
        print(f"| plan search, runtime {runtime} | {name} {size}, 1024 x h100-sxm, seq 4096, gbs 4096 | "
              f"{r.tried} layouts tried, {r.sized} sized, {len(r.ranked)} fit{before} | "
              f"first (cold) {statistics.median(first):.2f} s CPU, median of {FRESH_RUNS} fresh processes "
              f"({min(first):.2f}-{max(first):.2f}; in this one {cpu[0]:.2f} s, {times[0]:.2f} s wall); again: median "
              f"{statistics.median(cpu[1:]):.2f} s CPU ({statistics.median(times[1:]):.2f} s wall) | "
              f"top: {best.label}, {best.estimate.step_time:.2f} s/step, MFU {best.estimate.mfu:.1%} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--first", metavar="NAME", help="print the CPU seconds of one cold search of this model preset "
                                                     "in this process (what the table's first column runs)")
    ap.add_argument("--runtime", default="fivefold", help="with --first: the runtime profile (default fivefold)")
    ap.add_argument("--dp-modes", help="with --first: the data-parallel modes searched, comma-separated (default "
                                       "the runtime's; FSDP beside the distributed optimizer: optim,optim_grads_params)")
    args = ap.parse_args()
    if args.first:
        print(first_search(args.first, args.runtime, tuple(args.dp_modes.split(",")) if args.dp_modes else None))
    else:
        main()
