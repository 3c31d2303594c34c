"""Lowering: insert the sends and receives a compute-only schedule needs, from its stage placement.

For each computation on rank r:
  * F(s, mb) needs stage s-1's output; if stage s-1 lives on another rank q, a RECV_F(s, mb)<q;
    its output goes to stage s+1: if that is on another rank q, SEND_F(s, mb)>q right after it.
  * B/BW(s, mb) needs dL/d(output of s) from stage s+1: RECV_B(s, mb)<q when s+1 is on rank q != r;
    its input grad goes to stage s-1: SEND_B(s, mb)>q right after it when s-1 is on rank q != r.
  * W needs nothing from other ranks.
Sends go right after their producer (they never block). Receives go right before their consumer,
and a channel q -> r is drained in send order: before receiving message X, r also receives every
message q sent on that channel before X (it is there no later than X), so the receives on every
channel come in posting order, as NCCL's p2p matching requires, and no new wait is introduced.
A message with no sender is still given its RECV, for the verifier to report.
"""
from __future__ import annotations

from collections import defaultdict

from fivefold.pipeline.ir import Action, Kind, Schedule


def _needs(piece_kind: Kind, s: int, mb: int, rank: int, placement: tuple[int, ...]) -> list[Action]:
    """The receives a computation needs (peer = producer's rank), not counting local producers."""
    last = len(placement) - 1
    if piece_kind is Kind.F and s > 0 and placement[s - 1] != rank:
        return [Action(Kind.RECV_F, s, mb, peer=placement[s - 1])]
    if piece_kind in (Kind.B, Kind.BW) and s < last and placement[s + 1] != rank:
        return [Action(Kind.RECV_B, s, mb, peer=placement[s + 1])]
    return []


def _sends(piece_kind: Kind, s: int, mb: int, rank: int, placement: tuple[int, ...]) -> list[Action]:
    last = len(placement) - 1
    if piece_kind is Kind.F and s < last and placement[s + 1] != rank:
        return [Action(Kind.SEND_F, s, mb, peer=placement[s + 1])]
    if piece_kind in (Kind.B, Kind.BW) and s > 0 and placement[s - 1] != rank:
        return [Action(Kind.SEND_B, s, mb, peer=placement[s - 1])]
    return []


def _recv_for(message: tuple[str, int, int], sender: int) -> Action:
    kind, s, mb = message
    if kind == "F":
        return Action(Kind.RECV_F, s + 1, mb, peer=sender)
    return Action(Kind.RECV_B, s - 1, mb, peer=sender)


def lower(schedule: Schedule) -> Schedule:
    """`schedule` with SEND_*/RECV_* inserted; a schedule that already has them is returned as is."""
    if schedule.is_lowered():
        return schedule
    placement = schedule.placement
    with_sends: list[list[Action]] = []
    channel: dict[tuple[int, int], list[tuple[str, int, int]]] = defaultdict(list)  # (src, dst) -> messages
    for r, acts in enumerate(schedule.ranks):
        out: list[Action] = []
        for a in acts:
            out.append(a)
            for p in a.pieces():
                for send in _sends(p.kind, p.stage, p.mb, r, placement):
                    out.append(send)
                    channel[(r, send.peer)].append(send.message())
        with_sends.append(out)

    lowered: list[list[Action]] = []
    for r, acts in enumerate(with_sends):
        received: dict[int, int] = defaultdict(int)  # sender -> messages taken off channel (sender, r)
        out = []
        for a in acts:
            for p in a.pieces():
                for recv in _needs(p.kind, p.stage, p.mb, r, placement):
                    queue, msg = channel[(recv.peer, r)], recv.message()
                    if msg in queue[received[recv.peer]:]:
                        upto = queue.index(msg, received[recv.peer]) + 1
                        out += [_recv_for(m, recv.peer) for m in queue[received[recv.peer]:upto]]
                        received[recv.peer] = upto
                    elif msg not in queue:
                        out.append(recv)
            out.append(a)
        lowered.append(out)
    return schedule.with_ranks(lowered)
