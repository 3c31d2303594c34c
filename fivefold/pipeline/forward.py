"""Forward-only schedules (evaluation, log-probabilities): a training schedule without its backward.

`forward_only(s)` keeps, on every rank, the forwards in their order (an F&B keeps its F half) and
the SEND_F / RECV_F, and drops B, W, BW, SEND_B and RECV_B. It cannot deadlock when `s` cannot: the
waits that remain (RECV_F on its SEND_F, and each rank's program order among the kept actions) are a
subset of the original ones, so the kept actions can run in the order they ran in `s`.
"""
from __future__ import annotations

from fivefold.pipeline.ir import Action, Kind, Schedule

_KEEP = (Kind.F, Kind.SEND_F, Kind.RECV_F)


def forward_only(schedule: Schedule) -> Schedule:
    ranks = []
    for acts in schedule.ranks:
        kept: list[Action] = []
        for a in acts:
            if a.kind is Kind.FB:
                kept.append(Action(Kind.F, a.stage, a.mb))
            elif a.kind in _KEEP:
                kept.append(a)
        ranks.append(kept)
    return Schedule(f"{schedule.name}-forward", tuple(tuple(a) for a in ranks), schedule.placement,
                    schedule.num_microbatches)
