"""Simulator with unequal costs against timelines worked out by hand (derivations in the comments).

Costs are small integers, so simulated times are exact: compared with ==.
"""
from _tol import close
from fivefold.pipeline.schedules import build_schedule
from fivefold.pipeline.simulate import Costs, simulate


def _times(res, rank):
    return [(str(iv.action), iv.start, iv.end) for iv in res.timeline if iv.rank == rank]


def test_1f1b_slow_last_stage():
    """p=2, m=2. Stage 0: F=1, B=W=1 (BW=2). Stage 1 (slow): F=3, B=W=2 (BW=4). Orders: rank 0
    F0 F1 BW0 BW1, rank 1 F0 BW0 F1 BW1. Rank 1: F0 waits for rank 0's F0 (t=1) -> 1..4, BW0 4..8,
    F1 8..11 (input there since t=2), BW1 11..15. Rank 0: F0 0..1, F1 1..2, BW0 waits for the grad
    (t=8) -> 8..10, BW1 waits for t=15 -> 15..17. Makespan 17; busy 6 and 14 -> idle 11 and 3."""
    s = build_schedule("1f1b", 2, 2)
    res = simulate(s, Costs((1, 3), (1, 2), (1, 2)))
    assert _times(res, 0) == [("0F0", 0, 1), ("0F1", 1, 2), ("0BW0", 8, 10), ("0BW1", 15, 17)]
    assert _times(res, 1) == [("1F0", 1, 4), ("1BW0", 4, 8), ("1F1", 8, 11), ("1BW1", 11, 15)]
    assert res.makespan == 17 and res.idle == [11, 3]
    # 1 - busy/makespan vs idle/makespan differ in the last bit: 1e-12 absorbs the rounding only
    close(res.bubble, [11 / 17, 3 / 17], rtol=0, atol=1e-12, site="hand_timelines.bubble")


def test_1f1b_slow_last_stage_with_latency():
    """Same, p2p latency 0.5 per message: rank 1 F0 1.5..4.5, BW0 4.5..8.5, F1 8.5..11.5,
    BW1 11.5..15.5; rank 0 BW0 after the grad lands (8.5+0.5=9) 9..11, BW1 at 16 -> 16..18."""
    s = build_schedule("1f1b", 2, 2)
    res = simulate(s, Costs((1, 3), (1, 2), (1, 2), p2p_latency=0.5))
    assert _times(res, 0) == [("0F0", 0, 1), ("0F1", 1, 2), ("0BW0", 9, 11), ("0BW1", 16, 18)]
    assert _times(res, 1) == [("1F0", 1.5, 4.5), ("1BW0", 4.5, 8.5), ("1F1", 8.5, 11.5), ("1BW1", 11.5, 15.5)]
    assert res.makespan == 18


def test_gpipe_slow_middle_stage():
    """p=3, m=2, F=(1,2,1), B=W=(1,2,1). Forward wave: r0 F0 0..1 F1 1..2; r1 F0 1..3 F1 3..5;
    r2 F0 3..4 F1 5..6 BW0 6..8 BW1 8..10; r1 BW0 8..12 BW1 12..16; r0 BW0 12..14 BW1 16..18."""
    s = build_schedule("gpipe", 3, 2)
    res = simulate(s, Costs((1, 2, 1), (1, 2, 1), (1, 2, 1)))
    assert _times(res, 0) == [("0F0", 0, 1), ("0F1", 1, 2), ("0BW0", 12, 14), ("0BW1", 16, 18)]
    assert _times(res, 1) == [("1F0", 1, 3), ("1F1", 3, 5), ("1BW0", 8, 12), ("1BW1", 12, 16)]
    assert _times(res, 2) == [("2F0", 3, 4), ("2F1", 5, 6), ("2BW0", 6, 8), ("2BW1", 8, 10)]
    assert res.makespan == 18 and res.idle == [12, 6, 12]


def test_dualpipev_f_ne_b_by_hand():
    """DualPipeV p=2 (stages 0,3 on rank 0; 1,2 on rank 1), m=4, per chunk F=1, B=2, W=1, F&B=3.
    Outside the table's F = B condition its (p-1)(F&B+BW-3W) = 3 does not apply; by hand each
    rank idles 2 (makespan 31, busy 29). Rank 0 waits 11..12 for 2F2/1BW0 and 27..28 for 1B3;
    rank 1 waits 0..1 for 0F0."""
    s = build_schedule("dualpipev", 2, 4)
    res = simulate(s, Costs.uniform(4, 1, 2, 1, f_and_b=3))
    assert _times(res, 0) == [
        ("0F0", 0, 1), ("0F1", 1, 2), ("0F2", 2, 3), ("3F0", 3, 4), ("3B0", 4, 6), ("3W0", 6, 7),
        ("3F1", 7, 8), ("0F3&3BW1", 8, 11), ("3F2&0BW0", 12, 15), ("3BW2", 15, 18),
        ("3F3&0BW1", 18, 21), ("3BW3", 21, 24), ("0B2", 24, 26), ("0W2", 26, 27), ("0B3", 28, 30),
        ("0W3", 30, 31)]
    assert _times(res, 1) == [
        ("1F0", 1, 2), ("2F0", 2, 3), ("1F1", 3, 4), ("2F1", 4, 5), ("1F2", 5, 6), ("2BW0", 6, 9),
        ("2F2&1BW0", 9, 12), ("1F3&2BW1", 12, 15), ("2F3&1BW1", 15, 18), ("2BW2", 18, 21),
        ("1BW2", 21, 24), ("2B3", 24, 26), ("1B3", 26, 28), ("2W3", 28, 29), ("1W3", 29, 30)]
    assert res.makespan == 31 and res.idle == [2, 2]
