"""Event-driven simulation of a lowered schedule: makespan, bubble per rank, peak in-flight, timeline.

Each rank runs its actions in order on one compute stream. A computation starts when the previous
action of its rank has finished; a RECV finishes at max(the rank's clock, send time + p2p latency)
and takes no compute time; a SEND is posted at the rank's clock (right after its producer) and
takes none. Costs are per stage: F[s], B[s] (input backward), W[s] (weight backward), BW = B + W,
and an F&B pairing F(s) with BW(s') costs `f_and_b[s]` when given, else F[s] + B[s'] + W[s']
(no overlap).

  makespan     = latest finish over all ranks (every rank starts at time 0)
  bubble[r]    = 1 - busy[r] / makespan,  busy[r] = sum of rank r's compute costs
  in flight    = (stage, mb) pairs whose F has started and whose W (or BW) has not finished;
                 `peak_in_flight[r]` is the maximum count on rank r, and
                 `peak_in_flight_microbatches[r]` divides it by the rank's number of stages (with
                 equal layers per stage: activations in units of one microbatch through the rank's
                 whole share of layers).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fivefold.pipeline.ir import Action, Kind, Schedule, run_in_order


@dataclass(frozen=True)
class Costs:
    forward: tuple[float, ...]
    """F cost per stage."""
    backward_input: tuple[float, ...]
    """B cost per stage (the input-gradient half of the backward)."""
    backward_weight: tuple[float, ...]
    """W cost per stage (the weight-gradient half); BW costs B + W."""
    p2p_latency: float = 0.0
    """Time from a SEND to the earliest moment its RECV can complete."""
    f_and_b: tuple[float, ...] | None = None
    """Cost of an F&B action indexed by its forward stage; None = F + B + W of its halves."""

    @classmethod
    def uniform(cls, num_stages: int, f: float, b: float, w: float, p2p_latency: float = 0.0,
                f_and_b: float | None = None) -> "Costs":
        """Every stage costs the same."""
        fb = None if f_and_b is None else (f_and_b,) * num_stages
        return cls((f,) * num_stages, (b,) * num_stages, (w,) * num_stages, p2p_latency, fb)

    @classmethod
    def per_rank(cls, schedule: Schedule, f: float, b: float, w: float, p2p_latency: float = 0.0,
                 f_and_b: float | None = None) -> "Costs":
        """f, b, w are the costs of one rank's whole share of layers; each of its k stages costs 1/k."""
        k = [len(schedule.stages_of(schedule.placement[s])) for s in range(schedule.num_stages)]
        fb = None if f_and_b is None else tuple(f_and_b / x for x in k)
        return cls(tuple(f / x for x in k), tuple(b / x for x in k), tuple(w / x for x in k), p2p_latency, fb)

    def of(self, a: Action) -> float:
        if a.kind.is_comm:
            return 0.0
        if a.kind is Kind.FB:
            if self.f_and_b is not None:
                return self.f_and_b[a.stage]
            return self.forward[a.stage] + self.backward_input[a.b_stage] + self.backward_weight[a.b_stage]
        s, k = a.stage, a.kind
        if k is Kind.F:
            return self.forward[s]
        if k is Kind.B:
            return self.backward_input[s]
        if k is Kind.W:
            return self.backward_weight[s]
        return self.backward_input[s] + self.backward_weight[s]  # BW


@dataclass(frozen=True)
class Interval:
    rank: int
    start: float
    end: float
    action: Action


@dataclass
class SimResult:
    makespan: float
    busy: list[float]
    """Compute time per rank."""
    peak_in_flight: list[int]
    """Max live (stage, mb) activation sets per rank."""
    stages_per_rank: list[int]
    timeline: list[Interval] = field(default_factory=list)
    """Compute intervals (sends/receives excluded), in start order per rank."""

    @property
    def idle(self) -> list[float]:
        return [self.makespan - b for b in self.busy]

    @property
    def bubble(self) -> list[float]:
        """Bubble fraction per rank: idle time / makespan."""
        return [1 - b / self.makespan if self.makespan else 0.0 for b in self.busy]

    @property
    def peak_in_flight_microbatches(self) -> list[float]:
        return [n / k if k else 0.0 for n, k in zip(self.peak_in_flight, self.stages_per_rank)]


def simulate(schedule: Schedule, costs: Costs, timeline: bool = True) -> SimResult:
    """Run a lowered, verified schedule against `costs`; raises ValueError if it cannot finish.
    `timeline=False` leaves `SimResult.timeline` empty (the planner needs only the totals)."""
    n = schedule.num_ranks
    clock, busy = [0.0] * n, [0.0] * n
    live: list[set[tuple[int, int]]] = [set() for _ in range(n)]
    peak = [0] * n
    intervals: list[Interval] = []
    recv, send, freeing = (Kind.RECV_F, Kind.RECV_B), (Kind.SEND_F, Kind.SEND_B), (Kind.W, Kind.BW)

    def take(r: int, a: Action, landed: float | None) -> float | None:
        """A SEND returns the time its message can be received; a RECV gets that time (`landed`)."""
        kind = a.kind
        if kind in recv:
            clock[r] = max(clock[r], landed)
        elif kind in send:
            return clock[r] + costs.p2p_latency
        else:
            cost = costs.of(a)
            pieces = a.pieces()
            held = live[r]
            for p in pieces:
                if p.kind is Kind.F:
                    held.add((p.stage, p.mb))
            peak[r] = max(peak[r], len(held))
            if timeline:
                intervals.append(Interval(r, clock[r], clock[r] + cost, a))
            clock[r] += cost
            busy[r] += cost
            for p in pieces:
                if p.kind in freeing:
                    held.discard((p.stage, p.mb))
        return None

    pos = run_in_order(schedule, take)
    stuck = [r for r in range(n) if pos[r] < len(schedule.ranks[r])]
    if stuck:
        raise ValueError(f"schedule cannot finish: ranks {stuck} wait forever (run the verifier)")
    stages = [len(schedule.stages_of(r)) for r in range(n)]
    return SimResult(max(clock, default=0.0), busy, peak, stages, intervals)
