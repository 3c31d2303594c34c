"""Tolerance asserts that can report what they saw (docs/tolerances.md).

    close(got, want, rtol=1e-6, atol=0, site="moe.losses", case=name)

passes when |got - want| <= atol + rtol * |want| element-wise (torch.testing.assert_close's and
pytest.approx's rule), for tensors, lists, dicts or numbers, compared in float64 (exact for fp32 inputs).
`site` names the assert (one per line of a test); `case` the parameter, rank or tensor it checked.

With FIVEFOLD_TOL_LOG=path set, every call (in the test process and in every spawned rank, which
inherit the environment) first appends one JSON line to `path`: the largest absolute and relative
difference seen, the fraction of the bound used, the CPU kernels in use (ATen's capability and the
ISA variables) and the process id. `python scripts/tolerances.py report` turns the logs into the
table of docs/tolerances.md. Bit-exact results are asserted with torch.equal, not here.
"""
from __future__ import annotations

import json
import os
import time

import torch

LOG_VAR = "FIVEFOLD_TOL_LOG"
ISA_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def _as_float64(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64)
    return torch.tensor(x, dtype=torch.float64)


def _record(site: str, case: str, **fields) -> None:
    path = os.environ.get(LOG_VAR)
    if not path:
        return
    row = {"site": site, "case": case, **fields, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "env": {v: os.environ.get(v) for v in ISA_VARS}, "pid": os.getpid(), "time": time.time()}
    with open(path, "a") as f:  # one short line per write: appends from several ranks do not interleave
        f.write(json.dumps(row) + "\n")


def within(observed: float, bound: float, *, site: str, case: str = "") -> None:
    """observed <= bound, for a measure computed by the test (e.g. a relative difference in norm)."""
    observed = float(observed.detach() if isinstance(observed, torch.Tensor) else observed)
    _record(site, case, kind="within", observed=observed, bound=bound,
            used=observed / bound if bound else float("inf"))
    assert observed <= bound, f"{site} {case}: {observed:.3g} > bound {bound:.3g}"


def close(got, want, *, rtol: float, atol: float = 0.0, site: str, case: str = "") -> None:
    """Element-wise |got - want| <= atol + rtol * |want|; records the worst element (see module doc).
    Dicts are compared key by key (the same keys required)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{site} {case}: keys {list(got)} != {list(want)}"
        got, want = [got[k] for k in want], list(want.values())
    g, w = _as_float64(got), _as_float64(want)
    assert g.shape == w.shape, f"{site} {case}: shape {tuple(g.shape)} != {tuple(w.shape)}"
    same = (g == w) | (torch.isnan(g) & torch.isnan(w))  # equal infinities, and NaN in both (as equal_nan)
    finite = torch.isfinite(g) & torch.isfinite(w)
    diff = torch.where(same, 0.0, torch.where(finite, (g - w).abs(), torch.inf))  # any other NaN / inf: inf
    bound = atol + rtol * w.abs()
    used = torch.where(same, 0.0, torch.where(finite, diff / bound, torch.inf))  # diff > 0 over a zero bound: inf
    rel = torch.where(diff == 0, 0.0, diff / w.abs())
    worst = int(used.argmax()) if used.numel() else 0
    max_used = float(used.max()) if used.numel() else 0.0
    _record(site, case, kind="close", rtol=rtol, atol=atol, used=max_used, numel=g.numel(),
            max_abs=float(diff.max()) if diff.numel() else 0.0, max_rel=float(rel.max()) if rel.numel() else 0.0)
    if max_used > 1:
        gf, wf = g.flatten(), w.flatten()
        raise AssertionError(f"{site} {case}: |got - want| = {float(diff.flatten()[worst]):.3g} at element {worst} "
                             f"(got {float(gf[worst])!r}, want {float(wf[worst])!r}) exceeds atol={atol:g} + "
                             f"rtol={rtol:g} * |want| ({max_used:.3g}x the bound); largest relative difference "
                             f"{float(rel.max()):.3g}")
