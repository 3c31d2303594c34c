"""Search time of the planner: DeepSeek-V3 671B on 1024 H100s (goal: under a second).

    python benchmarks/plan_search.py      # prints one Markdown row for benchmarks/RESULTS.md
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivefold.planner.presets import hardware, model_preset  # noqa: E402
from fivefold.planner.search import search  # noqa: E402


def main() -> None:
    hw, m = hardware("h100-sxm"), model_preset("deepseek-v3").model
    times, cpu = [], []
    for _ in range(3):  # the first search is what `fivefold plan` pays; later ones reuse the per-split caches
        t0, c0 = time.perf_counter(), time.process_time()
        r = search(m, hw, 1024, 8, 4096, 4096)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    best = r.ranked[0]
    print(f"| plan search | deepseek-v3 671B, 1024 x h100-sxm, seq 4096, gbs 4096 | {r.tried} layouts sized, "
          f"{len(r.ranked)} fit | first {times[0]:.2f} s wall ({cpu[0]:.2f} s CPU); again: median "
          f"{statistics.median(times[1:]):.2f} s wall ({statistics.median(cpu[1:]):.2f} s CPU) | "
          f"top: {best.label}, {best.estimate.step_time:.2f} s/step, MFU {best.estimate.mfu:.1%} |")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # no options; -h says what it runs
    main()
