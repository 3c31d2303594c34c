"""Simulator vs closed forms: equal per-stage costs, zero p2p latency, inside each formula's conditions.

All costs are small binary fractions (1, 0.5, 1.5, ...), so every simulated time is exact in
floating point and the comparisons use a 1e-9 absolute tolerance only to absorb summation order.
"""
import pytest

from _tol import close
from fivefold.pipeline.schedules import build_schedule
from fivefold.pipeline.simulate import Costs, simulate

EXACT = 1e-9


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", [(1, 3), (2, 1), (2, 5), (3, 4), (4, 8), (5, 3), (6, 12)])
@pytest.mark.parametrize("f,b,w", [(1, 1, 1), (1, 1.5, 0.5)])
def test_gpipe_1f1b_bubble_fraction(name, pp, m, f, b, w):
    """Bubble fraction (p-1)/(m+p-1) on every rank, for any F and BW = B + W."""
    s = build_schedule(name, pp, m)
    res = simulate(s, Costs.uniform(pp, f, b, w))
    for r in range(pp):
        close(res.bubble[r], (pp - 1) / (m + pp - 1), rtol=0, atol=EXACT, site="schedule_formulas.bubble_gpipe_1f1b")


@pytest.mark.parametrize("pp,m", [(2, 2), (4, 8), (4, 3), (5, 9)])
def test_peak_in_flight_1f1b_vs_gpipe(pp, m):
    """1F1B keeps min(p, m) microbatches alive on the first rank (p - r on rank r); GPipe keeps m."""
    costs = Costs.uniform(pp, 1, 1, 1)
    one_f = simulate(build_schedule("1f1b", pp, m), costs)
    gp = simulate(build_schedule("gpipe", pp, m), costs)
    assert one_f.peak_in_flight[0] == min(pp, m)
    assert one_f.peak_in_flight == [min(pp - r, m) for r in range(pp)]
    assert gp.peak_in_flight == [m] * pp


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 2), (2, 3, 6), (3, 3, 6), (4, 2, 4), (4, 2, 8), (4, 3, 12)])
@pytest.mark.parametrize("f,b,w", [(1, 1, 1), (2, 1.5, 0.5)])
def test_interleaved_bubble_time(pp, vpp, m, f, b, w):
    """Idle time (p-1)(F+BW)/v per rank; F, BW are a rank's whole share, each chunk costs 1/v of it."""
    s = build_schedule("interleaved", pp, m, vpp)
    res = simulate(s, Costs.per_rank(s, f, b, w))
    for r in range(pp):
        close(res.idle[r], (pp - 1) * (f + b + w) / vpp, rtol=0, atol=EXACT, site="schedule_formulas.idle_interleaved")


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 6), (3, 5), (4, 4), (4, 8), (5, 11)])
@pytest.mark.parametrize("f,b,w", [(1, 1, 1), (1, 1.5, 0.5), (2, 1, 0.5), (1, 2, 1)])
def test_zb_h1_bubble_and_memory(pp, m, f, b, w):
    """ZB-H1 idles (p-1)(F+B-W) on its worst rank when W <= min(F, B) and m >= p; at most p in flight."""
    assert w <= min(f, b) and m >= pp  # the formula's conditions
    s = build_schedule("zb-h1", pp, m)
    res = simulate(s, Costs.uniform(pp, f, b, w))
    close(max(res.idle), (pp - 1) * (f + b - w), rtol=0, atol=EXACT, site="schedule_formulas.idle_zb_h1")
    assert max(res.peak_in_flight) <= pp


@pytest.mark.parametrize("pp,m", [(2, 4), (2, 7), (3, 6), (4, 8), (4, 13), (5, 12)])
@pytest.mark.parametrize("f,w,fb", [(1, 1, 3), (1, 0.5, 2.5), (1, 1, 2), (2, 1, 4), (1, 0.5, 1.5)])
def test_dualpipev_vs_deepseek_table(pp, m, f, w, fb):
    """DeepSeek-V3's DualPipe bubble (PP/2-1)(F&B+B-3W) on PP = 2p devices is (p-1)(F&B+BW-3W) for
    DualPipeV on p ranks and 2p stages (B there is the full backward, our BW). Exact when F = B
    (here per chunk), on the rank that idles most."""
    b = f  # the table's condition
    s = build_schedule("dualpipev", pp, m)
    res = simulate(s, Costs.uniform(2 * pp, f, b, w, f_and_b=fb))
    close(max(res.idle), (pp - 1) * (fb + (b + w) - 3 * w), rtol=0, atol=EXACT, site="schedule_formulas.idle_dualpipev")
    # Peak memory: 2p+1 chunk activations (p + 1/2 microbatches of a rank's share): the 2(p-r-1) + 2(r+1)
    # warm-up forwards, plus the F&B whose forward starts before its backward frees one.
    assert max(res.peak_in_flight) == 2 * pp + 1
