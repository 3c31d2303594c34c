"""Where a profiled GPU step's kernel launches go (the trace `fivefold train --profile` writes):

    python scripts/trace_launches.py runs/x/profile/rank-0.pt.trace.json[.gz]

For the last profiled `train_step N`: its time and the optimizer's (`Optimizer.step#...`), the kernels
it launched and the host syncs, the launches between consecutive attention kernels (F: forward, B:
backward; one decoder layer's worth each, so dense and MoE layers read apart), and the kernels
launched most often. An eager runtime whose step is far above its kernel time is host-bound: these
counts say where (benchmarks/RESULTS.md, "fivefold on one GPU")."""
from __future__ import annotations

import argparse
import collections
import gzip
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a torch profiler Chrome trace (.json or .json.gz)")
    args = ap.parse_args()
    try:
        with (gzip.open if args.trace.endswith(".gz") else open)(args.trace, "rt") as f:
            events = json.load(f)["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"error: {args.trace} is not a profiler trace ({e}); give the "
                         "OUT/profile/rank-R.pt.trace.json that `fivefold train --profile` writes")
    marks = [e for e in events if e.get("cat") == "user_annotation"]
    steps = [e for e in marks if e["name"].startswith("train_step")]
    if not steps:
        raise SystemExit(f"error: {args.trace} has no `train_step N` range: profile a training run "
                         "(`fivefold train ... --profile`)")
    step = max(steps, key=lambda e: e["ts"])
    lo, hi = step["ts"], step["ts"] + step["dur"]
    opt = [e for e in marks if e["name"].startswith("Optimizer.step") and lo <= e["ts"] <= hi]
    calls = sorted((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and lo <= e["ts"] <= hi),
                   key=lambda e: e["ts"])
    launches = [e for e in calls if "aunch" in e["name"]]
    syncs = [e for e in calls if "Synchronize" in e["name"]]
    kernel = {e["args"]["correlation"]: e["name"] for e in events if e.get("cat") == "kernel"}
    names = [kernel.get(e["args"].get("correlation"), "?") for e in launches]
    print(f"{step['name']}: {step['dur'] / 1e3:.1f} ms, optimizer {sum(e['dur'] for e in opt) / 1e3:.1f} ms; "
          f"{len(launches)} kernel launches, {len(syncs)} stream syncs")
    groups: list[list[int]] = []  # one attention call's kernels (a backward launches a few in a row)
    for i, n in enumerate(names):
        if "sdpa" in n or "attention" in n or "fmha" in n:
            if groups and i - groups[-1][-1] <= 4:
                groups[-1].append(i)
            else:
                groups.append([i])
    if groups:
        starts = [g[0] for g in groups] + [len(names)]
        kind = ["B" if any("bprop" in names[i] or "backward" in names[i] for i in g) else "F" for g in groups]
        parts = [f"{k}{b - a}" for k, a, b in zip(kind, starts, starts[1:])]
        print(f"launches before the first attention call: {starts[0]}; from each attention call to the next "
              f"(F forward, B backward; the last runs to the step's end): {' '.join(parts)}")
    for name, n in collections.Counter(n[:100] for n in names).most_common(12):
        print(f"{n:7d}  {name}")


if __name__ == "__main__":
    main()
