"""The pipeline schedule IR: per rank, an ordered list of actions; plus where each stage lives.

A model is cut into `num_stages` stages, stage 0 taking the input and stage S-1 computing the loss.
`placement[s]` is the rank that holds stage s:
  * one stage per rank (GPipe, 1F1B, ZB-H1): stage s on rank s;
  * interleaved with v chunks per rank: S = p*v, stage s on rank s % p (rank r holds r, r+p, ...);
  * DualPipeV (V shape): S = 2p, rank r holds stages r and 2p-1-r (rank 0 holds the first and last).
`Schedule.stages_of(rank)` lists a rank's stages in increasing order.

Actions (`Action.kind`), each for one microbatch `mb` on one stage `s`:
  F      forward of stage s (input: the output of stage s-1 for the same mb, or the data at s = 0)
  B      backward for inputs only: dL/d(input) of stage s (input: dL/d(output), i.e. the B of s+1,
         or the loss at s = S-1). Keeps what W needs (input activations, output grads).
  W      backward for weights: dL/d(params) of stage s; needs the B of (s, mb) done on this rank.
         Frees the activations of (s, mb).
  BW     full backward = B then W in one action.
  F&B    DualPipeV's overlapped pair: F of (s, mb) together with BW of (b_stage, b_mb); the two
         halves are independent and may run concurrently (compute of one hides communication of
         the other). Its cost is its own (see simulate.Costs).
  SEND_F send the output of F(s, mb) to `peer` (the rank of stage s+1); matches RECV_F(s+1, mb).
  RECV_F receive the input of stage s for mb from `peer` (the rank of stage s-1).
  SEND_B send dL/d(input) of stage s for mb to `peer` (the rank of stage s-1); matches RECV_B(s-1, mb).
  RECV_B receive dL/d(output) of stage s for mb from `peer` (the rank of stage s+1).
Execution semantics: a rank runs its list in order. SEND never blocks (isend; the executor waits
for its completion later, at a point send_waits.send_policy proves safe, since the wait lasts until
the peer posts the RECV). RECV blocks until the matching SEND has been posted. Messages between
two ranks are matched in posting order (as NCCL p2p is), so the verifier checks that a channel's
receives come in the order of its sends.

Text form (CSV cells, grids): `1F3` = stage 1 forward of microbatch 3; `2B0`, `2W0`, `2BW0`;
`0F4&7BW1` = F&B of stage 0 mb 4 with full backward of stage 7 mb 1; `0SEND_F3>1` = send stage 0's
output for mb 3 to rank 1; `1RECV_F3<0` = receive stage 1's input for mb 3 from rank 0.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import Callable, Iterator


class Kind(str, Enum):
    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    FB = "F&B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_comm(self) -> bool:
        return self in (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)


@dataclass(frozen=True)
class Piece:
    """One elementary computation: kind in F, B, W, BW, on (stage, microbatch). An F&B is two pieces."""

    kind: Kind
    stage: int
    mb: int


@dataclass(frozen=True)
class Action:
    kind: Kind
    stage: int
    mb: int
    peer: int | None = None
    """SEND_*/RECV_*: the other rank. None for compute actions."""
    b_stage: int | None = None
    """F&B only: the stage of the paired full backward."""
    b_mb: int | None = None
    """F&B only: the microbatch of the paired full backward."""

    def pieces(self) -> tuple[Piece, ...]:
        """The computations this action performs (none for send/recv)."""
        if self.kind.is_comm:
            return ()
        if self.kind is Kind.FB:
            return (Piece(Kind.F, self.stage, self.mb), Piece(Kind.BW, self.b_stage, self.b_mb))
        return (Piece(self.kind, self.stage, self.mb),)

    def message(self) -> tuple[str, int, int]:
        """Identity of the message a SEND/RECV carries: ('F'|'B', sending stage, mb)."""
        if self.kind is Kind.SEND_F or self.kind is Kind.SEND_B:
            return (self.kind.value[-1], self.stage, self.mb)
        if self.kind is Kind.RECV_F:
            return ("F", self.stage - 1, self.mb)
        if self.kind is Kind.RECV_B:
            return ("B", self.stage + 1, self.mb)
        raise ValueError(f"{self} is not a send or receive")

    def __str__(self) -> str:
        if self.kind is Kind.FB:
            return f"{self.stage}F{self.mb}&{self.b_stage}BW{self.b_mb}"
        if self.kind.is_comm:
            arrow = ">" if self.kind.value.startswith("SEND") else "<"
            return f"{self.stage}{self.kind.value}{self.mb}{arrow}{self.peer}"
        return f"{self.stage}{self.kind.value}{self.mb}"


_COMM = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B)(\d+)([<>])(\d+)$")
_FB = re.compile(r"^(\d+)F(\d+)&(\d+)BW(\d+)$")
_COMPUTE = re.compile(r"^(\d+)(BW|F|B|W)(\d+)$")


def parse_action(text: str) -> Action:
    """The inverse of `str(action)`; raises ValueError naming the text it could not read."""
    t = text.strip().replace(" ", "")
    if m := _COMM.match(t):
        kind = Kind(m.group(2))
        if (m.group(4) == ">") != kind.value.startswith("SEND"):
            raise ValueError(f"{text!r}: a SEND takes '>peer', a RECV '<peer'")
        return Action(kind, int(m.group(1)), int(m.group(3)), peer=int(m.group(5)))
    if m := _FB.match(t):
        return Action(Kind.FB, int(m.group(1)), int(m.group(2)), b_stage=int(m.group(3)), b_mb=int(m.group(4)))
    if m := _COMPUTE.match(t):
        return Action(Kind(m.group(2)), int(m.group(1)), int(m.group(3)))
    raise ValueError(f"{text!r} is not an action (forms: 1F3, 1B3, 1W3, 1BW3, 0F4&7BW1, 0SEND_F3>1, "
                     f"1RECV_F3<0, 1SEND_B3>0, 0RECV_B3<1)")


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered actions plus the stage -> rank placement; what an executor runs."""

    name: str
    ranks: tuple[tuple[Action, ...], ...]
    placement: tuple[int, ...]
    """placement[s] = rank holding stage s."""
    num_microbatches: int

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    def stages_of(self, rank: int) -> list[int]:
        """Stages held by `rank`, in increasing order."""
        return list(self._stages_by_rank.get(rank, ()))

    @cached_property
    def _stages_by_rank(self) -> dict[int, list[int]]:
        """Each rank's stages, from one pass over the placement (renderers ask per action)."""
        by_rank: dict[int, list[int]] = {}
        for s, r in enumerate(self.placement):
            by_rank.setdefault(r, []).append(s)
        return by_rank

    def is_lowered(self) -> bool:
        """True when sends/receives are present (or none are needed: one rank)."""
        return self.num_ranks == 1 or any(a.kind.is_comm for acts in self.ranks for a in acts)

    def actions(self) -> Iterator[tuple[int, int, Action]]:
        """(rank, index in its list, action) for every action."""
        for r, acts in enumerate(self.ranks):
            for i, a in enumerate(acts):
                yield r, i, a

    def with_ranks(self, ranks: list[list[Action]]) -> "Schedule":
        return Schedule(self.name, tuple(tuple(a) for a in ranks), self.placement, self.num_microbatches)


def run_in_order(schedule: Schedule, take: Callable[[int, Action, object], object] | None = None,
                 ready: Callable[[int, Action, list[int]], bool] | None = None) -> list[int]:
    """The untimed run of the execution semantics above, shared by the verifier and the simulator.

    Each rank takes its actions in order: a SEND is posted and never blocks; a RECV is
    taken only once a matching SEND has been posted (each SEND satisfies one RECV, in posting order).
    `take(rank, action, carried)` is called on each action as it is taken; what it returns for a SEND
    is carried by the message and handed to the RECV that takes it (`carried`; None otherwise): the
    simulator sends the time the message lands. `ready(rank, action, pos)`, when given, may hold a
    rank before an action until the other ranks' positions `pos` allow it (send_waits: a send that
    is waited before a computation blocks until its receive is posted). Returns where each rank
    stopped: len(its actions) when it finished, else the index of its blocked action.
    """
    pos = [0] * schedule.num_ranks
    posted: dict[tuple, list] = {}  # (src, dst, message) -> what the SENDs not yet received carry
    waiting: dict[tuple, int] = {}  # (src, dst, message) -> the rank stopped at that RECV
    # Ranks to run until they stop. Without `ready` a rank stops only at a RECV, and only its SEND
    # moves it on: that rank is run again when the SEND is posted, so each action is looked at about
    # once (a sweep over every rank until none moves took pp sweeps of pp ranks, one rank of a
    # backward wave per sweep: minutes at PP 4000). Each rank takes its actions in order and a RECV
    # waits for its SEND only, so any order of running the ranks ends at the same positions with the
    # same values carried. `ready` may read any rank's position: then every rank is run again after
    # any moved.
    everyone = list(range(schedule.num_ranks - 1, -1, -1))  # popped from the end: rank 0 first
    todo, moved = list(everyone), False
    while todo:
        r = todo.pop()
        acts = schedule.ranks[r]
        while pos[r] < len(acts):
            a = acts[pos[r]]
            if ready is not None and not ready(r, a, pos):
                break
            carried = None
            if a.kind is Kind.RECV_F or a.kind is Kind.RECV_B:
                key = (a.peer, r, a.message())
                queue = posted.get(key)
                if not queue:
                    waiting[key] = r  # its SEND is not posted yet: run the other ranks
                    break
                carried = queue.pop(0)
                if take is not None:
                    take(r, a, carried)
            elif a.kind is Kind.SEND_F or a.kind is Kind.SEND_B:
                out = take(r, a, None) if take is not None else None
                key = (r, a.peer, a.message())
                posted.setdefault(key, []).append(out)
                if key in waiting:
                    todo.append(waiting.pop(key))
            elif take is not None:
                take(r, a, None)
            pos[r] += 1
            moved = True
        if moved and ready is not None and not todo:  # a pass over every rank after any moved
            todo, moved = [q for q in everyone if pos[q] < len(schedule.ranks[q])], False
    return pos


def standard_placement(pp: int, chunks_per_rank: int = 1) -> tuple[int, ...]:
    """Stage s on rank s % pp: one stage per rank, or `chunks_per_rank` interleaved chunks."""
    return tuple(s % pp for s in range(pp * chunks_per_rank))


def v_placement(pp: int) -> tuple[int, ...]:
    """DualPipeV: 2*pp stages, rank r holds stages r and 2*pp-1-r."""
    return tuple(s if s < pp else 2 * pp - 1 - s for s in range(2 * pp))
