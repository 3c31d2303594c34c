"""When a rank waits for its sends: the earliest point that cannot deadlock, so sent buffers are freed.

A sent activation's storage can be freed (Megatron's deallocate trick) only once its send has
completed, and a send completes only once the peer has posted the matching receive: gloo's isend is
a rendezvous (a 4 KB send waits as long as its receiver sleeps, and `Work.is_completed()` stays
False until `wait()`), and an NCCL send likewise holds its stream until the peer receives. So a rank
must wait its sends at a chosen point, and that wait blocks it until the peer reaches the receive;
a point chosen too early deadlocks (interleaved 1F1B, PP2: rank 0 sends 2B0 and waits for it before
0F3, while rank 1 sends 3B1 and waits for it before 1F2; each receive comes after the other's wait).

A policy gives each message kind a lag: a send posted after the rank's k-th computation is waited
before its computation k + lag (0: before the next computation, so a sent activation is gone before
the next forward allocates one; 1: once the next computation is done), or at the end of the step
(None, which the verifier's run already proves safe). `send_policy` returns the first of POLICIES
under which the rendezvous run completes (ir.run_in_order with a send waited at its point blocking
until the peer has reached its receive; the executor posts a whole run of sends and receives before
waiting, so the real receive is posted no later than the model's). For the built-in schedules:
GPipe, 1F1B and ZB-H1 get (0, 0), DualPipeV (0, 1) and interleaved 1F1B (1, 1).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from fivefold.pipeline.ir import Action, Kind, Schedule, run_in_order


@dataclass(frozen=True)
class SendPolicy:
    forward: int | None
    """Computations after its producer that a SEND_F (activation) is waited before; None = step end."""
    backward: int | None
    """The same for a SEND_B (input gradient)."""

    def lag(self, kind: Kind) -> int | None:
        return self.forward if kind is Kind.SEND_F else self.backward


POLICIES = (SendPolicy(0, 0), SendPolicy(0, 1), SendPolicy(1, 0), SendPolicy(1, 1), SendPolicy(None, None))


def completes(schedule: Schedule, policy: SendPolicy) -> bool:
    """Whether every rank finishes when sends are waited as `policy` says (rendezvous semantics)."""
    recv_at: dict[tuple, int] = {}  # (src, dst, message) -> index of the RECV on dst
    for r, i, a in schedule.actions():
        if a.kind in (Kind.RECV_F, Kind.RECV_B):
            recv_at[(a.peer, r, a.message())] = i
    computed = [0] * schedule.num_ranks
    due: list[dict[int, list[tuple]]] = [defaultdict(list) for _ in range(schedule.num_ranks)]

    def take(r: int, a: Action, carried) -> None:
        if not a.kind.is_comm:
            due[r].pop(computed[r], None)
            computed[r] += 1
        elif a.kind in (Kind.SEND_F, Kind.SEND_B) and policy.lag(a.kind) is not None:
            due[r][computed[r] + policy.lag(a.kind)].append((r, a.peer, a.message()))

    def ready(r: int, a: Action, pos: list[int]) -> bool:
        if a.kind.is_comm:
            return True
        return all(pos[dst] >= recv_at[(src, dst, m)] for src, dst, m in due[r].get(computed[r], ()))

    pos = run_in_order(schedule, take, ready)
    return all(p == len(acts) for p, acts in zip(pos, schedule.ranks))


def send_policy(schedule: Schedule) -> SendPolicy:
    """The earliest policy of POLICIES that cannot deadlock `schedule` (a verified, lowered one)."""
    return next(p for p in POLICIES if p.forward is None or completes(schedule, p))
