"""Measured schedules: per-action timings from a run, as the simulator's result type (pure).

A traced run gives, for each rank, the (start, end) of every action of its list (seconds, each
rank's clock started after a barrier at the start of the step). `measured_result` turns them into a
SimResult whose timeline holds the computations (sends/receives are the gaps), so the renderer
draws a measured run exactly as it draws a simulated one, in milliseconds:

  makespan   = latest end - earliest start over all ranks
  bubble[r]  = 1 - (time rank r spent computing) / makespan

`stage_costs` averages the measured durations per (kind, stage): the simulator run on those
uniform per-stage costs gives the bubble the schedule would have if every microbatch cost the same,
which is what the measured bubble is compared with. A full backward BW counts as B with W = 0 when
the run has no split B/W for that stage; an F&B pair gets its own measured cost.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from fivefold.pipeline.ir import Kind, Schedule
from fivefold.pipeline.simulate import Costs, Interval, SimResult

MS = 1e3


def measured_result(schedule: Schedule, times: Sequence[Sequence[tuple[float, float]]]) -> SimResult:
    """SimResult of a traced run; `times[r][i]` is (start, end) of action i of rank r, in seconds."""
    starts = [t[0] for row in times for t in row]
    t0 = min(starts, default=0.0)
    timeline, busy, makespan = [], [0.0] * schedule.num_ranks, 0.0
    for r, acts in enumerate(schedule.ranks):
        if len(times[r]) != len(acts):
            raise ValueError(f"rank {r}: {len(times[r])} timings for {len(acts)} actions")
        for a, (start, end) in zip(acts, times[r]):
            makespan = max(makespan, (end - t0) * MS)
            if a.kind.is_comm:
                continue
            timeline.append(Interval(r, (start - t0) * MS, (end - t0) * MS, a))
            busy[r] += (end - start) * MS
    stages = [len(schedule.stages_of(r)) for r in range(schedule.num_ranks)]
    return SimResult(makespan, busy, [0] * schedule.num_ranks, stages, timeline)


def stage_costs(schedule: Schedule, result: SimResult) -> Costs:
    """Mean measured cost (ms) of F, B, W and F&B per stage, as simulator Costs (p2p latency 0)."""
    sums: dict[tuple[Kind, int], list[float]] = defaultdict(list)
    for iv in result.timeline:
        sums[(iv.action.kind, iv.action.stage)].append(iv.end - iv.start)

    def mean(kind: Kind, s: int) -> float | None:
        xs = sums.get((kind, s))
        return sum(xs) / len(xs) if xs else None

    n = schedule.num_stages
    f = [mean(Kind.F, s) or 0.0 for s in range(n)]
    b, w = [], []
    for s in range(n):
        bs, ws, bw = mean(Kind.B, s), mean(Kind.W, s), mean(Kind.BW, s)
        if bs is not None and ws is not None:
            b.append(bs)
            w.append(ws)
        else:
            b.append(bw or 0.0)
            w.append(0.0)
    fb = None
    if any(k is Kind.FB for k, _ in sums):
        fb = tuple(mean(Kind.FB, s) or (f[s] + b[s] + w[s]) for s in range(n))
    return Costs(tuple(f), tuple(b), tuple(w), 0.0, fb)
