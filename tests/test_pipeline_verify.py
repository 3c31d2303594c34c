"""Verifier: generated schedules pass over ranges of (pp, vpp, microbatches); broken ones are refused
with the rank-by-step grid marking the offending action; the rule and the generators agree."""
import re

import pytest
from hypothesis import given, settings, strategies as st

from fivefold.errors import UserError
from fivefold.pipeline.ir import Action, Kind, Schedule, parse_action
from fivefold.pipeline.schedules import REGISTRY, build_schedule, microbatch_problem
from fivefold.pipeline.simulate import Costs, simulate
from fivefold.pipeline.verify import ScheduleError, problems, verify


def _sched(rows: list[str], placement, m) -> Schedule:
    ranks = tuple(tuple(parse_action(x) for x in row.split()) for row in rows)
    return Schedule("hand", ranks, tuple(placement), m)


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(list(REGISTRY)), pp=st.integers(1, 6), vpp=st.sampled_from([None, 1, 2, 3, 4]),
       m=st.integers(0, 16))
def test_rule_and_generators_agree(name, pp, vpp, m):
    """What the rule accepts builds, verifies and simulates; what it refuses raises its message."""
    problem = microbatch_problem(name, pp, vpp, m)
    if problem:
        with pytest.raises(UserError, match=re.escape(problem)):
            build_schedule(name, pp, m, vpp)
        return
    s = verify(build_schedule(name, pp, m, vpp))
    res = simulate(s, Costs.uniform(s.num_stages, 1, 1, 1))
    assert res.makespan > 0
    if name == "1f1b":
        assert res.peak_in_flight == [min(pp - r, m) for r in range(pp)]
    if name == "zb-h1":
        assert max(res.peak_in_flight) <= pp


def test_text_form_round_trip():
    for name, vpp in [("interleaved", 2), ("dualpipev", None), ("zb-h1", None)]:
        s = build_schedule(name, 3, 6, vpp)
        assert all(parse_action(str(a)) == a for _, _, a in s.actions())
    assert str(parse_action("0F4&7BW1")) == "0F4&7BW1"
    with pytest.raises(ValueError, match="not an action"):
        parse_action("F3")


def test_stage_placement():
    assert build_schedule("interleaved", 4, 8, 2).stages_of(1) == [1, 5]
    assert build_schedule("dualpipev", 4, 8).stages_of(1) == [1, 6]
    assert build_schedule("dualpipev", 4, 8).placement == (0, 1, 2, 3, 3, 2, 1, 0)


def test_missing_receive_is_refused_with_grid():
    good = _sched(["0F0 0SEND_F0>1 0RECV_B0<1 0BW0", "1RECV_F0<0 1F0 1BW0 1SEND_B0>0"], [0, 1], 1)
    verify(good)
    broken = _sched(["0F0 0SEND_F0>1 0RECV_B0<1 0BW0", "1F0 1BW0 1SEND_B0>0"], [0, 1], 1)
    with pytest.raises(ScheduleError) as err:
        verify(broken)
    text = str(err.value)
    assert "1F0 runs before 1RECV_F0" in text and ">>1F0<<" in text
    assert "0SEND_F0>1: rank 1 never receives it" in text and ">>0SEND_F0>1<<" in text
    assert "rank 1 " in text.splitlines()[-1]  # the grid closes the message, one row per rank


def test_action_before_its_input_is_refused():
    broken = _sched(["0F0 0F1 0BW1 0BW0"], [0, 0], 2)  # stage 0 then stage 1 on one rank
    with pytest.raises(ScheduleError) as err:
        verify(broken)
    assert "0BW1 runs before 1B1" in str(err.value) and ">>0BW1<<" in str(err.value)
    assert "1F0 is missing" in str(err.value)


def test_wait_cycle_is_refused():
    """Rank 0 waits for a gradient before sending the activation rank 1 needs to produce it."""
    cyc = _sched(["0F0 0RECV_B0<1 0SEND_F0>1 0BW0", "1RECV_F0<0 1F0 1BW0 1SEND_B0>0"], [0, 1], 1)
    found = problems(cyc)
    assert [(r, i) for r, i, _ in found] == [(0, 1), (1, 0)]
    assert "wait cycle: rank 0 -> rank 1 -> rank 0" in found[0][2]


def test_channel_order_is_checked():
    """Two messages on one channel received in the opposite order of sending (NCCL would mismatch)."""
    s = _sched(["0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0BW0 0RECV_B1<1 0BW1",
                "1RECV_F1<0 1RECV_F0<0 1F0 1BW0 1SEND_B0>0 1F1 1BW1 1SEND_B1>0"], [0, 1], 2)
    assert any("delivers in send order" in msg for _, _, msg in problems(s))


def test_duplicate_and_wrong_rank():
    s = _sched(["0F0 0F0 0BW0", "1F0 1BW0"], [0, 0], 1)
    assert any("stage 1 lives on rank 0, not 1" in msg for _, _, msg in problems(s))
