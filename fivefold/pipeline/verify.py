"""The verifier: proves a lowered schedule complete, dependency-correct and deadlock-free, statically.

Checks, in order (each failure names the rank and position of the offending action):
  1. shape: stages and microbatches in range; a computation runs on the rank that holds its stage;
     a send/recv names the peer that holds the neighbouring stage.
  2. completeness: every (stage, mb) has exactly one F and either one BW or one B and one W.
  3. local order: on its rank, an action comes after what it consumes: F(s) after F(s-1) when
     s-1 is local, else after RECV_F(s); B/BW(s) after F(s) and after B/BW(s+1) (local) or
     RECV_B(s); W after B; a SEND after the computation that produces its message.
  4. matching: every SEND has exactly one RECV of the same message on its peer and vice versa, and
     each channel (sender -> receiver) is received in the order it is sent (NCCL matches in order).
  5. no cycle of waits: an untimed run in which SEND never blocks and RECV waits for its SEND; if
     it stops before every rank is done, the blocked RECVs are reported with the wait cycle.
On failure `verify` raises ScheduleError whose message ends with the rank-by-step grid, the
offending action shown as `>>1F3<<`; a grid larger than GRID_RANKS x GRID_STEPS is cut to the window
around the first problem, saying what was left out.
"""
from __future__ import annotations

from collections import Counter, defaultdict

from fivefold.errors import UserError
from fivefold.pipeline.ir import Kind, Schedule, run_in_order


SHOWN = 20
"""Problems a ScheduleError's message lists at most (all are in `.problems`): a schedule CSV naming
microbatch 100000 alone misses 200,000 actions, one line each."""


class ScheduleError(UserError):
    """A schedule that cannot run: the message lists the problems (the first SHOWN) and prints the grid."""

    def __init__(self, problems: list[tuple[int, int, str]], grid: str):
        self.problems = problems
        lines = [f"  - rank {r} step {i}: {msg}" for r, i, msg in problems[:SHOWN]]
        if len(problems) > SHOWN:
            lines.append(f"  ... and {len(problems) - SHOWN:,} more ({len(problems):,} problems in all)")
        super().__init__("invalid pipeline schedule:\n" + "\n".join(lines) + "\n" + grid)


GRID_RANKS, GRID_STEPS = 32, 40
"""Ranks (rows) and steps (columns) of the grid a ScheduleError prints at most: a schedule CSV of
10,000 rows printed a 10,000-line grid; past these the grid is the window around the first problem."""


def _window(n: int, at: int, most: int) -> range:
    """`most` consecutive indices of range(n) with `at` near the middle (all of them when n <= most)."""
    lo = min(max(at - most // 2, 0), max(n - most, 0))
    return range(lo, min(n, lo + most))


def grid(schedule: Schedule, marked: set[tuple[int, int]] = frozenset(),
         around: tuple[int, int] | None = None) -> str:
    """Rank-by-step table of the actions; cells in `marked` (rank, step) are shown as >>action<<. At
    most GRID_RANKS x GRID_STEPS cells, around (rank, step) `around` (default the first cell), with a
    line saying which ranks and steps are shown when some are left out."""
    steps = max((len(acts) for acts in schedule.ranks), default=0)
    r0, i0 = around or (0, 0)
    ranks = _window(len(schedule.ranks), r0, GRID_RANKS)
    cols = _window(steps, i0, GRID_STEPS)
    cells = {r: [(f">>{a}<<" if (r, i) in marked else str(a))
                 for i, a in enumerate(schedule.ranks[r][cols.start:cols.stop], cols.start)] for r in ranks}
    width = max([len(x) for row in cells.values() for x in row] + [4])
    label = max([len(str(r)) for r in ranks] + [2])
    head = f"{'step':<{label + 5}} " + " ".join(f"{i:<{width}}" for i in cols)
    rows = [f"rank {r:<{label}}" + "".join(f" {x:<{width}}" for x in row) for r, row in cells.items()]
    lines = [head.rstrip()] + [row.rstrip() for row in rows]
    cut = [f"{what} {shown.start}-{shown.stop - 1} of {n:,} ({n - len(shown):,} left out)"
           for what, shown, n in (("ranks", ranks, len(schedule.ranks)), ("steps", cols, steps)) if len(shown) < n]
    if cut:
        lines.insert(0, f"grid cut around rank {r0} step {i0}: showing {' and '.join(cut)}")
    return "\n".join(lines)


def _shape(s: Schedule) -> list[tuple[int, int, str]]:
    out = []
    S, M = s.num_stages, s.num_microbatches
    for r, i, a in s.actions():
        stages = [p.stage for p in a.pieces()] or [a.stage]
        if any(not 0 <= st < S for st in stages) or any(not 0 <= p.mb < M for p in a.pieces()) \
                or not 0 <= a.mb < M:
            out.append((r, i, f"{a}: stage or microbatch out of range ({S} stages, {M} microbatches)"))
            continue
        for p in a.pieces():
            if s.placement[p.stage] != r:
                out.append((r, i, f"{a}: stage {p.stage} lives on rank {s.placement[p.stage]}, not {r}"))
        if a.kind.is_comm:
            if s.placement[a.stage] != r:
                out.append((r, i, f"{a}: stage {a.stage} lives on rank {s.placement[a.stage]}, not {r}"))
            other = {Kind.SEND_F: a.stage + 1, Kind.RECV_F: a.stage - 1,
                     Kind.SEND_B: a.stage - 1, Kind.RECV_B: a.stage + 1}[a.kind]
            if not 0 <= other < S or s.placement[other] != a.peer or a.peer == r:
                out.append((r, i, f"{a}: no stage {other} on rank {a.peer} to exchange with"))
    return out


def _completeness(s: Schedule) -> list[tuple[int, int, str]]:
    seen: Counter = Counter()
    where: dict = {}
    for r, i, a in s.actions():
        for p in a.pieces():
            seen[(p.kind, p.stage, p.mb)] += 1
            where.setdefault((p.kind, p.stage, p.mb), (r, i))
    out = []
    for key, n in seen.items():
        if n > 1:
            out.append((*where[key], f"{key[1]}{key[0].value}{key[2]} appears {n} times"))
    for st in range(s.num_stages):
        r = s.placement[st]
        end = len(s.ranks[r])
        for mb in range(s.num_microbatches):
            f, b, w, bw = (seen[(k, st, mb)] for k in (Kind.F, Kind.B, Kind.W, Kind.BW))
            if not f:
                out.append((r, end, f"{st}F{mb} is missing"))
            if not (bw or (b and w)):
                what = f"{st}W{mb}" if b else f"{st}B{mb}" if w else f"{st}BW{mb} (or {st}B{mb} + {st}W{mb})"
                out.append((r, end, f"{what} is missing"))
            if bw and (b or w):
                out.append((*where[(Kind.BW, st, mb)], f"{st}BW{mb} and a split {st}B/{st}W{mb} both present"))
    return out


def _local_order(s: Schedule) -> list[tuple[int, int, str]]:
    out = []
    last = s.num_stages - 1
    for r, acts in enumerate(s.ranks):
        done: set[tuple[str, int, int]] = set()  # ("F"|"B"|"W"|"RF"|"RB", stage, mb) seen so far
        for i, a in enumerate(acts):
            need: list[tuple[str, int, int]] = []
            for p in a.pieces():
                st, mb = p.stage, p.mb
                if p.kind is Kind.F and st > 0:
                    need.append(("F", st - 1, mb) if s.placement[st - 1] == r else ("RF", st, mb))
                if p.kind in (Kind.B, Kind.BW):
                    need.append(("F", st, mb))
                    if st < last:
                        need.append(("B", st + 1, mb) if s.placement[st + 1] == r else ("RB", st, mb))
                if p.kind is Kind.W:
                    need.append(("B", st, mb))
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                need.append((a.kind.value[-1], a.stage, a.mb))
            names = {"F": "F", "B": "B", "W": "W", "RF": "RECV_F", "RB": "RECV_B"}
            for n in need:
                if n not in done:
                    out.append((r, i, f"{a} runs before {n[1]}{names[n[0]]}{n[2]}, which it needs, on rank {r}"))
            for p in a.pieces():
                if p.kind is Kind.BW:
                    done |= {("B", p.stage, p.mb), ("W", p.stage, p.mb)}
                else:
                    done.add((p.kind.value, p.stage, p.mb))
            if a.kind is Kind.RECV_F:
                done.add(("RF", a.stage, a.mb))
            if a.kind is Kind.RECV_B:
                done.add(("RB", a.stage, a.mb))
    return out


def _matching(s: Schedule) -> list[tuple[int, int, str]]:
    sends: dict[tuple[int, int], list[tuple[tuple, int]]] = defaultdict(list)  # (src, dst) -> [(msg, step)]
    recvs: dict[tuple[int, int], list[tuple[tuple, int]]] = defaultdict(list)
    for r, i, a in s.actions():
        if a.kind in (Kind.SEND_F, Kind.SEND_B):
            sends[(r, a.peer)].append((a.message(), i))
        elif a.kind in (Kind.RECV_F, Kind.RECV_B):
            recvs[(a.peer, r)].append((a.message(), i))
    out = []
    for src, dst in sorted(set(sends) | set(recvs)):
        sent, got = sends[(src, dst)], recvs[(src, dst)]
        sent_msgs, got_msgs = Counter(m for m, _ in sent), Counter(m for m, _ in got)
        for m, i in sent:
            if got_msgs[m] < sent_msgs[m]:
                out.append((src, i, f"{s.ranks[src][i]}: rank {dst} never receives it"))
        for m, i in got:
            if sent_msgs[m] < got_msgs[m]:
                out.append((dst, i, f"{s.ranks[dst][i]}: rank {src} never sends it"))
        matched = [m for m, _ in sent if got_msgs[m]]
        order = [(m, i) for m, i in got if sent_msgs[m]]
        for k, (m, i) in enumerate(order):
            if k < len(matched) and matched[k] != m:
                out.append((dst, i, f"{s.ranks[dst][i]}: channel {src}->{dst} delivers in send order, "
                                    f"and rank {src} sends {matched[k]} first"))
                break
    return out


def _deadlock(s: Schedule) -> list[tuple[int, int, str]]:
    pos = run_in_order(s)
    blocked = [r for r in range(s.num_ranks) if pos[r] < len(s.ranks[r])]
    if not blocked:
        return []
    # follow "r waits on peer" links from the first blocked rank to expose the cycle
    chain, r = [], blocked[0]
    while r not in chain and pos[r] < len(s.ranks[r]):
        chain.append(r)
        r = s.ranks[r][pos[r]].peer
    cycle = " -> ".join(f"rank {x}" for x in chain + [r])
    return [(b, pos[b], f"{s.ranks[b][pos[b]]} waits forever (wait cycle: {cycle})") for b in blocked]


def problems(schedule: Schedule) -> list[tuple[int, int, str]]:
    """Every problem found, as (rank, step, message); empty when the schedule is valid."""
    found = _shape(schedule)
    if found:
        return found
    found = _completeness(schedule) + _local_order(schedule) + _matching(schedule)
    return found or _deadlock(schedule)


def verify(schedule: Schedule) -> Schedule:
    """`schedule` itself when valid; raises ScheduleError with the marked grid otherwise."""
    found = problems(schedule)
    if found:
        raise ScheduleError(found, grid(schedule, {(r, i) for r, i, _ in found}, around=found[0][:2]))
    return schedule
