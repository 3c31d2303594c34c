"""Pure: measured timings -> SimResult (bubble by hand), per-stage mean costs, forward-only schedules."""
from _tol import close
from fivefold.pipeline.forward import forward_only
from fivefold.pipeline.schedules import build_schedule
from fivefold.pipeline.ir import Kind
from fivefold.pipeline.trace import measured_result, stage_costs


def test_measured_bubble_and_costs_by_hand():
    s = build_schedule("gpipe", 2, 1)  # rank 0: F0, SEND_F, RECV_B, BW0; rank 1: RECV_F, F0, BW0, SEND_B
    assert [a.kind for a in s.ranks[0]] == [Kind.F, Kind.SEND_F, Kind.RECV_B, Kind.BW]
    assert [a.kind for a in s.ranks[1]] == [Kind.RECV_F, Kind.F, Kind.BW, Kind.SEND_B]
    times = [[(10.000, 10.001), (10.001, 10.001), (10.001, 10.005), (10.005, 10.007)],
             [(10.000, 10.001), (10.001, 10.002), (10.002, 10.005), (10.005, 10.005)]]
    r = measured_result(s, times)
    # Python floats: seconds (~10) differenced and scaled to ms keep ~1e-12 relative rounding
    close(r.makespan, 7.0, rtol=1e-6, site="trace.makespan")  # ms, from the earliest start to the latest end
    close(r.busy, [3.0, 4.0], rtol=1e-6, site="trace.busy")  # F + BW per rank; sends/receives are not compute
    close(r.bubble, [1 - 3 / 7, 1 - 4 / 7], rtol=1e-6, site="trace.bubble")
    c = stage_costs(s, r)
    close(c.forward, (1.0, 1.0), rtol=1e-6, site="trace.forward_cost")
    close(c.backward_input, (2.0, 3.0), rtol=1e-6, site="trace.backward_input_cost")
    assert c.backward_weight == (0.0, 0.0)  # no split B/W measured: BW counts as B


def test_forward_only_keeps_forwards_in_order():
    s = build_schedule("dualpipev", 2, 4)
    f = forward_only(s)
    for full, fwd in zip(s.ranks, f.ranks):
        assert all(a.kind in (Kind.F, Kind.SEND_F, Kind.RECV_F) for a in fwd)
        expected = [(p.stage, p.mb) for a in full for p in a.pieces() if p.kind is Kind.F]
        assert [(a.stage, a.mb) for a in fwd if a.kind is Kind.F] == expected
