"""The planner against published GPU training runs (benchmarks/data/gpu-runs.tsv).

    python benchmarks/calibrate.py            # the table for benchmarks/RESULTS.md
    python benchmarks/calibrate.py --assumed  # and every unstated value taken, per row
    python benchmarks/calibrate.py --fit      # refit each runtime's free time constants, and
                                              # leave-one-source-out (minutes of CPU)
    python benchmarks/calibrate.py --rank     # where each published layout ranks in `plan`'s search

For every row not excluded (`fivefold.planner.calibration.runs.EXCLUDED`, with reasons): the planner's
throughput (tokens/s per GPU, of the runtime that ran it) against the published one, the error
est/pub - 1, whether the planner judges the published layout to fit, and its peak memory against the
published figure on the source's basis (reserved GiB or tensor GB, `MEMORY_BASIS`).
"""
from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import fields
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivefold.planner.calibration.runs import EXCLUDED, FLOP_COUNTS, OUT_OF_SAMPLE, read_runs
from fivefold.planner.calibration.cases import cases, flops_per_token, runtime_of, stated_layout
from fivefold.planner.layout import Plan  # noqa: E402
from fivefold.planner.memory.peak import peak_memory  # noqa: E402
from fivefold.planner.presets import hardware  # noqa: E402
from fivefold.planner.search.configs import describe  # noqa: E402
from fivefold.planner.calibration.runtime import PROFILES, Runtime, apply, profile, with_time  # noqa: E402
from fivefold.planner.search.space import SearchSpace
from fivefold.planner.search.ranking import clear_caches, evaluate, search
from fivefold.planner.search.configs import with_a2a_overlap, with_tp_overlap
from fivefold.planner.search.compare import held_text, held_to, rank_of  # noqa: E402
from fivefold.planner.time.time_assumptions import TimeAssumptions  # noqa: E402
from fivefold.planner.time.steptime import step_time  # noqa: E402

GiB = 2**30


FREE = {"megatron-te": ("gemm_efficiency", "fp8_gemm_efficiency", "attention_efficiency", "expert_efficiency",
                         "expert_half_rows", "membound_passes", "tp_overlap", "ep_overlap", "ep_overlap_1f1b"),
        "torchtitan": ("gemm_efficiency", "fp8_gemm_efficiency", "attention_efficiency", "attention_half_keys",
                       "membound_passes", "tp_overlap", "cp_overlap")}
"""The constants fitted per runtime (physical: achieved shares of peak, overlap shares, HBM passes)."""
HELD_OUT_OF_LOSO = ("attention_half_keys", "expert_half_rows", "tp_overlap")
"""Fitted on all of a runtime's rows, held when a source is left out: a kernel's constant, pinned by
one sweep (torchtitan's CP rows 28-31); left free, leaving the two H200 rows out drives it to its
8192 bound and the memory-bound passes to 0 (two rows cannot pin seven constants)."""
MAMF = 1.0
"""No kernel runs faster than the best matmul measured on the device class: the shares are of that
ceiling (`Hardware.achievable_flops`: stas00/ml-engineering's Maximum Achievable Matmul FLOPS, per GPU
and precision), so their bound is 1: a fit above the ceiling trades a physical constant for another's
error."""
BOUNDS = {"expert_half_rows": (0.0, 8192.0), "attention_half_keys": (0.0, 8192.0), "membound_passes": (0.0, 40.0),
          **{n: (0.05, MAMF) for n in ("gemm_efficiency", "fp8_gemm_efficiency", "attention_efficiency",
                                       "expert_efficiency")}}
"""Bounds other than (0.05, 1) for a share."""
DEFAULTS = {f.name: f.default for f in fields(TimeAssumptions)}
START = {"attention_half_keys": 1024.0, "expert_half_rows": 1024.0}
"""Where a fit starts for a constant whose default (0) turns its effect off."""


def compare(case, runtime: str | Runtime | None = None) -> dict:
    """The planner's figures for one case, under `runtime` (default: the case's own)."""
    hw = hardware(case.hardware_name)
    rt = runtime_of(case, runtime if isinstance(runtime, Runtime) else profile(runtime or case.runtime))
    plan = Plan(apply(case.config, rt, case.fp32_grads))
    mem = peak_memory(plan, rt.memory)
    est = step_time(plan, hw, rt.time)
    out = {"row": case.run.row, "source": case.run.source, "fits": mem.total <= hw.memory_bytes,
           "memory": mem, "hw": hw, "estimate": est, "published": case.tokens_per_s, "case": case}
    if case.tokens_per_s:
        out["error"] = est.tokens_per_s_per_gpu / case.tokens_per_s - 1
    if case.memory_bytes:
        on_basis = mem.total - mem.reserve if case.memory_basis == "reserved GiB" else \
            mem.total - mem.reserve - mem.overhead
        out["memory_ratio"] = on_basis / case.memory_bytes
        # a published figure over the device's memory is a breakdown, not a run that fit (row 45)
        out["published_fits"] = case.memory_bytes <= hw.memory_bytes
    return out


def error_text(results: list[dict]) -> str:
    errs = [abs(r["error"]) for r in results if "error" in r]
    return f"|error| median {statistics.median(errs):.1%}, max {max(errs):.1%} over {len(errs)} rows"


def summary(results: list[dict]) -> str:
    ran = [r for r in results if r.get("published_fits", True)]
    fits = sum(r["fits"] for r in ran)
    mem = [r["memory_ratio"] for r in results if "memory_ratio" in r]
    fitted = [r for r in results if r["row"] not in OUT_OF_SAMPLE]
    unseen = [r for r in results if r["row"] in OUT_OF_SAMPLE]
    return (f"{len(results)} rows judged ({len(EXCLUDED)} excluded); judged to fit: {fits}/{len(ran)} (rows whose "
            f"published memory exceeds the device's left out: {len(results) - len(ran)}); "
            f"throughput on the rows fitted {error_text(fitted)}"
            + (f"; out of sample (rows {', '.join(str(r['row']) for r in unseen)}, added after the fit) "
               f"{error_text(unseen)}" if unseen else "")
            + f"; memory est/pub {min(mem):.2f}-{max(mem):.2f} over {len(mem)} rows")


PUBLISHED_TIE = 0.01
"""Two runs of one workload published within 1% of each other are not ordered (rows 48 / 49: 1861.8 both)."""


def workload(case) -> tuple:
    """What two published runs must share for their throughputs to rank their layouts: the source
    (one software version and cluster), model, GPU type and count, sequence, global batch, precision."""
    t = case.config.training
    return (case.run.source, case.model_name, case.hardware_name, case.config.cluster.world_size, t.seq_length,
            t.global_batch_size, t.precision)


def measured_order(results: list[dict]) -> dict[str, list[tuple[int, int]]]:
    """Pairs of rows measuring two layouts (or switches) of one workload, faster one first, by whether
    the planner orders them as published: "same", "reversed", or "tied" (one estimate for both: what
    tells them apart is not modelled). The ranking's evidence from measurements: the search's other
    layouts were never run."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        if "error" in r:
            groups.setdefault(workload(r["case"]), []).append(r)
    out: dict[str, list[tuple[int, int]]] = {"same": [], "reversed": [], "tied": []}
    for rows in groups.values():
        for i, a in enumerate(rows):
            for b in rows[i + 1:]:
                fast, slow = (a, b) if a["published"] > b["published"] else (b, a)
                if fast["published"] <= slow["published"] * (1 + PUBLISHED_TIE):
                    continue
                ours = fast["estimate"].tokens_per_s_per_gpu, slow["estimate"].tokens_per_s_per_gpu
                verdict = "tied" if math.isclose(*ours, rel_tol=1e-9) else "same" if ours[0] > ours[1] else "reversed"
                out[verdict].append((fast["row"], slow["row"]))
    return out


def order_text(order: dict[str, list[tuple[int, int]]]) -> str:
    pairs = sum(len(v) for v in order.values())
    named = "; ".join(f"{k}: " + ", ".join(f"{a} > {b}" for a, b in v) for k, v in order.items() if v)
    return (f"measured alternatives (rows of one source, model, GPUs, sequence, batch and precision; published "
            f"within {PUBLISHED_TIE:.0%} left out): {len(order['same'])} of {pairs} pairs ordered as published "
            f"({named})")


def residuals(rt: Runtime, rows: list, names: tuple[str, ...], x) -> list[float]:
    """log(estimated / published) of each row with `names` set to `x`."""
    trial = with_time(rt, **dict(zip(names, map(float, x))))
    clear_caches()  # the layer-cost caches are keyed by the constants: keep them small
    return [math.log(1 + compare(c, trial)["error"]) for c in rows]


def start_of(rt: Runtime, names: tuple[str, ...]) -> list[float]:
    """Where a fit of `names` starts: the profile's values (within bounds), `START` for those off."""
    return [min(max(getattr(rt.time, n) or START.get(n, 0.5), BOUNDS.get(n, (0.05, 1.0))[0]),
                BOUNDS.get(n, (0.05, 1.0))[1]) for n in names]


def unused(rt: Runtime, rows: list, names: tuple[str, ...]) -> tuple[str, ...]:
    """The names none of `rows` depends on (e.g. the fp8 rate, with no fp8 row): 10% off moves no
    residual."""
    x0 = start_of(rt, names)
    base = residuals(rt, rows, names, x0)
    return tuple(n for i, n in enumerate(names)
                 if residuals(rt, rows, names, [v * 0.9 if j == i else v for j, v in enumerate(x0)]) == base)


def fit(rt: Runtime, rows: list, names: tuple[str, ...]) -> tuple[Runtime, tuple[str, ...]]:
    """`rt` with `names` fitted: least squares of log(estimated / published) over `rows`; and the
    `unused` names, which take their physical default (`TimeAssumptions`'s) instead of wherever a flat
    fit leaves them."""
    import numpy as np
    try:
        from scipy.optimize import least_squares
    except ImportError:
        sys.exit("calibrate.py --fit needs SciPy's least squares: pip install scipy")

    off = unused(rt, rows, names)
    rt = with_time(rt, **{n: DEFAULTS[n] for n in off})
    names = tuple(n for n in names if n not in off)
    lo = [BOUNDS.get(n, (0.05, 1.0))[0] for n in names]
    hi = [BOUNDS.get(n, (0.05, 1.0))[1] for n in names]
    got = least_squares(lambda x: np.array(residuals(rt, rows, names, x)), start_of(rt, names), bounds=(lo, hi),
                        diff_step=0.02)
    return with_time(rt, **{n: round(float(v), 3) for n, v in zip(names, got.x)}), off


def fit_report(all_cases: list, only: str | None = None) -> None:
    for name, names in FREE.items():
        if only and name != only:
            continue
        rows = [c for c in all_cases if c.runtime == name and c.tokens_per_s and c.run.row not in OUT_OF_SAMPLE]
        fitted = fit(PROFILES[name], rows, names)[0]
        print(f"{name}: fitted on rows {', '.join(str(c.run.row) for c in rows)}: "
              + ", ".join(f"{n}={getattr(fitted.time, n)}" for n in names)
              + f"; {error_text([compare(c, fitted) for c in rows])}")
        unseen = [compare(c, fitted) for c in all_cases if c.runtime == name and c.run.row in OUT_OF_SAMPLE]
        if unseen:
            print(f"  out of sample (`OUT_OF_SAMPLE`, not fitted): {error_text(unseen)}")
        for source in sorted({c.run.source for c in rows}):
            rest = [c for c in rows if c.run.source != source]
            if not rest:
                continue
            held, unused = fit(fitted, rest, tuple(n for n in names if n not in HELD_OUT_OF_LOSO))
            errs = sorted(abs(compare(c, held)["error"]) for c in rows if c.run.source == source)
            print(f"  leave out {source}: fitted on the other {len(rest)} rows, its {len(errs)} rows' |error| "
                  f"median {statistics.median(errs):.1%}, max {errs[-1]:.1%}"
                  + (f" ({', '.join(unused)} at the default: no row left depends on it)" if unused else ""))


def rank_report(all_cases: list, runtime: str | None) -> None:
    """For each case, `plan`'s search on its model, GPUs, sequence, batch and precision under its
    runtime: the published layout's rank among the fitting layouts (every unstated field as assumed;
    run with the runtime's switches as the search runs every layout),
    the rank of the first layout with the fields the source states (the unstated ones free:
    `calibration.stated_layout`), and the top choice beside them."""
    print("| row | source | model | GPUs | published layout | unstated | rank as assumed | rank, unstated free "
          "| step time / top | top choice | beyond the top 5: held to its own |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ranks, free_ranks, full, ratios, held_full = [], [], [], [], []
    for c in all_cases:
        rt = runtime_of(c, profile(runtime or c.runtime) if (runtime or c.runtime) in PROFILES else profile("megatron-te"))
        hw, cfg = hardware(c.hardware_name), apply(c.config, rt, c.fp32_grads)
        t = cfg.training
        result = search(cfg.model, hw, cfg.cluster.world_size, c.gpus_per_node, t.seq_length, t.global_batch_size,
                        t.precision, rt.space(accumulate=c.accumulates), rt.memory, rt.time,
                        grad_reduce_in_bf16=t.grad_reduce_in_bf16)
        # the published layout as the search runs it: the runtime's switches (the 1F1B all-to-all
        # overlap, TP overlap, where allowed) are not layout choices, so a row that ran without one
        # competes with it
        cfg = with_tp_overlap(cfg) if rt.tp_comm_overlap else cfg
        published = evaluate(with_a2a_overlap(cfg) if rt.a2a_overlap else cfg, hw, rt.memory, rt.time)
        rank = rank_of(published, result.ranked)
        states = stated_layout(c)
        free = next((i for i, cand in enumerate(result.ranked, 1) if states(cand.config)), None)
        free = min(filter(None, (rank, free)), default=None)
        ranks.append(rank)
        free_ranks.append(free)
        held = held_to(published, result.ranked) if rank and rank > 5 else None
        if not c.unstated - {"fsdp", "etp"}:
            full.append(free)
            held_full.append(bool(held) and free > 5)
        top = result.ranked[0] if result.ranked else None
        if rank and top:
            ratios.append(published.estimate.step_time / top.estimate.step_time)
        ratio = f"{ratios[-1]:.2f}" if rank and top else "-"
        where = f"{rank} of {len(result.ranked)}" if rank else f"not fitting: {published.problem[:60]}"
        print(f"| {c.run.row} | {c.run.source} | {c.model_name} | {cfg.cluster.world_size} x {c.hardware_name} | "
              f"{describe(cfg)} | {', '.join(sorted(c.unstated)) or '-'} | {where} | {free or '-'} | {ratio} | "
              f"{top.label if top else '-'} | "
              f"{held_text(published, held).removeprefix('held to its ') if held else '-'} |")

    def top5(found: list) -> str:
        return f"{sum(1 for r in found if r and r <= 5)} of {len(found)}"

    print(f"\npublished layouts in the top 5: {top5(ranks)} as assumed; {top5(free_ranks)} with the unstated fields "
          f"free; {top5(full)} of the rows whose source states the whole layout (TP CP PP VPP DP EP mbs recompute "
          f"split), and {sum(held_full)} more that rank in the top 5 held to one or two of their own choices; "
          f"judged not to fit: {sum(r is None for r in ranks)}; median rank of the fitting ones: "
          f"{statistics.median([r for r in ranks if r]) if any(ranks) else '-'} as assumed, "
          f"{statistics.median([r for r in free_ranks if r]) if any(free_ranks) else '-'} unstated free")
    # many layouts lie within the time model's own error of the top: how far the published one is
    print(f"published step time within 5% / 10% of the top choice's: {sum(x <= 1.05 for x in ratios)} / "
          f"{sum(x <= 1.10 for x in ratios)} of {len(ratios)}; median ratio {statistics.median(ratios):.2f}"
          if ratios else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--assumed", action="store_true", help="list the value taken for every unstated field")
    ap.add_argument("--runtime", choices=tuple(PROFILES),
                    help="predict every row with this runtime profile instead of its own (with --fit: fit only it)")
    ap.add_argument("--fit", action="store_true", help="refit each runtime's free constants and leave one source out")
    ap.add_argument("--rank", action="store_true", help="rank each published layout among the search's layouts")
    args = ap.parse_args()
    if args.fit:
        fit_report(cases(), args.runtime)
        return
    if args.rank:
        rank_report(cases(), args.runtime)
        return
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
        if not r.get("published_fits", True):
            fits += f"; published {c.memory_bytes / GiB:.0f} GiB does not fit either"
        print(f"| {c.run.row} | {c.run.source} | {c.model_name} | {c.config.cluster.world_size} x {c.hardware_name} | "
              f"{describe(c.config)} | {args.runtime or c.runtime} | {pub} | {r['estimate'].tokens_per_s_per_gpu:.0f} | "
              f"{err} | {fits} | {memtxt} |")
    print()
    print(summary(results))
    print(order_text(measured_order(results)))
    print()
    print("Excluded: " + "; ".join(f"row {k}: {v}" for k, v in EXCLUDED.items()))
    both = [(r, c) for r in read_runs() for c in [r] if r.num("tokens_per_s_per_gpu") and r.num("tflops_per_gpu")]
    if both:
        from fivefold.planner.calibration.cases import case_of
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
