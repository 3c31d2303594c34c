"""Measure every tolerance of the test suite under several CPU kernel settings (docs/tolerances.md).

    python scripts/tolerances.py run                  # every file with a tolerance, every setting, one at a time
    python scripts/tolerances.py run --settings native --files tests/test_moe.py
    python scripts/tolerances.py report               # the table: worst case per assert site and setting

`run` runs pytest on one test file at a time (the machine may have 2 cores) with FIVEFOLD_TOL_LOG
pointing at OUT/<setting>.jsonl, so every tolerance assert (tests/_tol.py) records what it saw, in
the test process and in every spawned rank. A failing file is reported and the run goes on: the log
still holds what was measured before the failure. `report` reads the logs and prints, per assert
site, the bound, the worst relative / absolute difference under each setting, the fraction of the
bound used and the CPU capability the recording processes really ran with.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARGIN = 10.0
"""Bounds are set to this multiple of the worst case seen (docs/tolerances.md)."""
SETTINGS = {  # name -> environment added to the run (inherited by spawned ranks and launched workers)
    "native": {},
    "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "onednn-avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
}
ISA_VARS = {k for s in SETTINGS.values() for k in s}
SENSITIVE = [  # files whose tolerances cover torch fp32 / fp64 kernels: measured under every setting
    "test_model_init.py", "test_train_parts.py", "test_dp_reducer.py", "test_tp_layers.py", "test_model_hf.py",
    "test_model_hf_load.py", "test_model_hf_mla.py", "test_model_hf_moe.py", "test_tp_model.py",
    "test_pipeline_executor.py", "test_mla.py", "test_train_dp.py", "test_train_tp.py", "test_zero.py",
    "test_cp.py", "test_moe.py", "test_precision.py", "test_zero2.py", "test_model_hf_olmoe.py", "test_mtp.py",
    "test_moe_router.py",
]
PURE = [  # tolerances on Python floats only (no torch kernel): the CPU setting cannot change them
    "test_pipeline_formulas.py", "test_pipeline_hand_timelines.py", "test_pipeline_trace.py",
    "test_planner_collectives.py", "test_planner_memory.py", "test_planner_search.py",
]


def run(settings: list[str], files: list[str], out: Path, append: bool = False) -> int:
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for name in settings:
        log = out / f"{name}.jsonl"
        if not append:
            log.unlink(missing_ok=True)
        inherited = {k: v for k, v in os.environ.items() if k not in ISA_VARS}  # "native" means none set
        env = {**inherited, **SETTINGS[name], "FIVEFOLD_TOL_LOG": str(log),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        for f in files:
            path = f if "/" in f else f"tests/{f}"
            t0 = time.monotonic()
            rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path], cwd=ROOT,
                                 env=env, stdout=subprocess.DEVNULL if not os.environ.get("VERBOSE") else None)
            print(f"{name:13s} {path:40s} {'ok' if rc == 0 else f'FAILED (exit {rc})'}  {time.monotonic() - t0:.0f} s",
                  flush=True)
            if rc:
                failed.append((name, path))
    for name, path in failed:
        print(f"failed: {path} under {name} (rerun: {' '.join(f'{k}={v}' for k, v in SETTINGS[name].items())} "
              f"python -m pytest {path})")
    return 1 if failed else 0


def _fmt(x: float) -> str:
    return "0" if x == 0 else f"{x:.1e}"


def nice_up(x: float) -> float:
    """The smallest of 1, 2, 5 x 10^k that is >= x."""
    k = math.floor(math.log10(x))
    return next(m * 10.0 ** k for m in (1, 2, 5, 10) if m * 10.0 ** k >= x * (1 - 1e-9))


def _rescaled(used: float, old: tuple, new: tuple) -> float | None:
    """A record's used fraction under the site's current bound, when that bound is the old one scaled
    (rtol and atol by the same factor); None when it is not (then the site must be measured again)."""
    if old == new or used == 0:
        return used
    ratios = {float(f"{o / n:.9g}") if n else math.inf for o, n in zip(old, new) if o is not None and (o or n)}
    if len(ratios) != 1 or 0 in ratios or math.inf in ratios:
        return None
    return used * ratios.pop()


def suggest(bound: tuple, used: float) -> str:
    """MARGIN x the worst case, rounded up to 1 / 2 / 5 x 10^k; mixed bounds scaled together."""
    if used == 0:
        return "exact: torch.equal?"
    rtol, atol, bound = bound
    f = MARGIN * used
    if bound is not None:
        return f"<= {_fmt(nice_up(bound * f))}"
    return f"rtol {_fmt(nice_up(rtol * f) if rtol else 0)} atol {_fmt(nice_up(atol * f) if atol else 0)}"


def _records(out: Path) -> list[dict]:
    """Every record of every log, oldest first (by the time it was written)."""
    rows = []
    for log in out.glob("*.jsonl"):
        rows += [{**json.loads(line), "setting": log.stem} for line in log.read_text().splitlines()]
    return sorted(rows, key=lambda r: r["time"])


def report(out: Path, markdown: bool) -> None:
    records = _records(out)
    current = {r["site"]: (r.get("rtol"), r.get("atol"), r.get("bound")) for r in records}  # the newest bound
    sites: dict[str, dict] = defaultdict(dict)
    procs: dict[str, dict] = defaultdict(lambda: defaultdict(set))
    for r in records:
        name, site = r["setting"], r["site"]
        procs[name][(r["cpu_capability"], json.dumps(r["env"], sort_keys=True))].add(r["pid"])
        w = sites[site].setdefault(name, {"used": 0.0, "rel": 0.0, "abs": 0.0, "case": ""})
        w["rel"] = max(w["rel"], r.get("max_rel", r.get("observed", 0.0)))
        w["abs"] = max(w["abs"], r.get("max_abs", 0.0))
        used = _rescaled(r["used"], (r.get("rtol"), r.get("atol"), r.get("bound")), current[site])
        if used is None or w["used"] is None:
            w["used"] = None  # measured under a bound that is not a multiple of today's: measure again
        elif used >= w["used"]:
            w["used"], w["case"] = used, r["case"]
    names = [n for n in SETTINGS if n in procs]
    print("recording processes per setting (CPU capability, ISA variables): count")
    for name in names:
        for (cap, env), pids in procs[name].items():
            print(f"  {name:13s} {cap:8s} {env}: {len(pids)} processes")
    print()
    head = ["site", "bound"] + [f"{n} rel / abs" for n in names] + ["worst used", f"{MARGIN:g}x margin", "worst case"]
    rows = []
    for site, by in sorted(sites.items()):
        rt, at, b = current[site]
        bound = f"rtol {_fmt(rt)} atol {_fmt(at)}" if b is None else f"<= {_fmt(b)}"
        cells = [f"{_fmt(by[n]['rel'])} / {_fmt(by[n]['abs'])}" if n in by else "-" for n in names]
        if any(w["used"] is None for w in by.values()):
            rows.append([site, bound, *cells, "?", "measure again", ""])
            continue
        worst = max(by.values(), key=lambda w: w["used"])
        rows.append([site, bound, *cells, f"{worst['used']:.2g}", suggest(current[site], worst["used"]), worst["case"]])
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        widths = [max(len(str(x[i])) for x in [head, *rows]) for i in range(len(head))]
        for r in [head, *rows]:
            print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run test files under CPU kernel settings, recording every tolerance")
    r.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    r.add_argument("--files", nargs="+", default=SENSITIVE + PURE, help="test files (default: every file with a tolerance)")
    r.add_argument("--out", type=Path, default=ROOT / "runs" / "tolerances", help="where the logs go")
    r.add_argument("--append", action="store_true", help="add to the logs instead of starting them afresh")
    q = sub.add_parser("report", help="print the worst case of each assert site from the logs")
    q.add_argument("--out", type=Path, default=ROOT / "runs" / "tolerances", help="where the logs are")
    q.add_argument("--markdown", action="store_true", help="a markdown table")
    a = p.parse_args(argv)
    if a.cmd == "run":
        unknown = [s for s in a.settings.split(",") if s not in SETTINGS]
        if unknown:
            p.error(f"unknown setting(s) {unknown}; choose from {', '.join(SETTINGS)}")
        return run(a.settings.split(","), a.files, a.out, a.append)
    if not any(a.out.glob("*.jsonl")):
        p.error(f"no logs in {a.out}: run `python scripts/tolerances.py run` first")
    report(a.out, a.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
