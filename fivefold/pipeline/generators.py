"""Schedule generators: the per-rank compute order of GPipe, 1F1B, interleaved 1F1B, ZB-H1, DualPipeV.

Each generator returns the compute actions only; fivefold.pipeline.schedules holds the registry entry of
each (placement, chunks, rule) and `build_schedule`, which checks the rule, then lowers (inserts
sends/receives from the placement). Notation: p
ranks, m microbatches, rank r (0-based), v chunks per rank.

* GPipe: every rank runs F of all m microbatches, then BW of all m. Peak in flight: m.
* 1F1B (PipeDream-Flush): rank r warms up with min(p-r-1, m) forwards, then alternates F, BW, then
  drains the remaining BW. At most p-r microbatches in flight on rank r.
* Interleaved 1F1B (Megatron): stage c*p + r is chunk c of rank r. The microbatches run in groups of N
  (Megatron's microbatch_group_size_per_vp_stage, default p; the last group takes the remainder):
  a group's N microbatches run chunk 0 forward, then chunk 1, ..., then the next group. Virtual
  microbatch k is the k-th (microbatch, chunk) of that order forward; backward walks the same order
  with the chunks reversed. Rank r warms up with min(2(p-r-1) + (v-1)N, m*v) forwards, then
  alternates F, BW. Needs p <= N <= m and the last group empty or >= p (else it waits on itself).
* ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B with the backward split into B and W.
  Rank r may postpone up to r weight passes (its 1F1B in-flight count p-r plus r postponed W makes
  p), so B passes, on the critical path, run earlier and the postponed W fill the cooldown bubble.
* DualPipeV (DeepSeek's cut-in-half DualPipe): 2p stages in a V, rank r holds stages r (chunk 0)
  and 2p-1-r (chunk 1). The eight phases of the reference schedule: 2(p-r-1) F0; r+1 (F0, F1);
  p-r-1 (B1, W, F1); m-2p+r+1 (F0&BW1, F1&BW0); p-r-1 (BW1, F1&BW0); r+1 (B1, B0) with the second
  half split into B + W; p-r-1 (W, B0); r+1 W. Needs m >= 2p.
"""
from __future__ import annotations

from collections import deque

from fivefold.pipeline.ir import Action, Kind


def gpipe(pp: int, m: int) -> list[list[Action]]:
    return [[Action(Kind.F, r, i) for i in range(m)] + [Action(Kind.BW, r, i) for i in range(m)]
            for r in range(pp)]


def one_f_one_b(pp: int, m: int) -> list[list[Action]]:
    ranks = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        acts = [Action(Kind.F, r, i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [Action(Kind.F, r, warmup + i), Action(Kind.BW, r, i)]
        acts += [Action(Kind.BW, r, i) for i in range(m - warmup, m)]
        ranks.append(acts)
    return ranks


def interleaved(pp: int, vpp: int, m: int, group: int | None = None) -> list[list[Action]]:
    n = group or pp
    table = [(mb, c) for start in range(0, m, n)
             for c in range(vpp) for mb in range(start, m if start + n >= m else start + n)]
    total = len(table)

    ranks = []
    for r in range(pp):
        def f(k: int) -> Action:
            mb, c = table[k]
            return Action(Kind.F, c * pp + r, mb)

        def bw(k: int) -> Action:
            mb, c = table[k]
            return Action(Kind.BW, (vpp - 1 - c) * pp + r, mb)

        warmup = min(2 * (pp - r - 1) + (vpp - 1) * n, total)
        acts = [f(k) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [f(warmup + k), bw(k)]
        acts += [bw(k) for k in range(total - warmup, total)]
        ranks.append(acts)
    return ranks


def zb_h1(pp: int, m: int) -> list[list[Action]]:
    ranks = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        acts = [Action(Kind.F, r, i) for i in range(warmup)]
        pending: deque[int] = deque()  # microbatches whose W is postponed, oldest first
        for i in range(m - warmup):
            acts += [Action(Kind.F, r, warmup + i), Action(Kind.B, r, i)]
            pending.append(i)
            if len(pending) > r:
                acts.append(Action(Kind.W, r, pending.popleft()))
        for i in range(m - warmup, m):
            acts.append(Action(Kind.B, r, i))
            pending.append(i)
            acts.append(Action(Kind.W, r, pending.popleft()))
        acts += [Action(Kind.W, r, i) for i in pending]
        ranks.append(acts)
    return ranks


def dualpipev(pp: int, m: int) -> list[list[Action]]:
    ranks = []
    for r in range(pp):
        stage = (r, 2 * pp - 1 - r)  # chunk 0 goes down the V, chunk 1 comes back up
        next_f, next_b = [0, 0], [0, 0]
        weights: deque[tuple[int, int]] = deque()
        acts: list[Action] = []

        def f(c: int) -> Action:
            next_f[c] += 1
            return Action(Kind.F, stage[c], next_f[c] - 1)

        def b(c: int, split: bool = False) -> Action:
            next_b[c] += 1
            if split:
                weights.append((stage[c], next_b[c] - 1))
                return Action(Kind.B, stage[c], next_b[c] - 1)
            return Action(Kind.BW, stage[c], next_b[c] - 1)

        def w() -> Action:
            s, mb = weights.popleft()
            return Action(Kind.W, s, mb)

        def f_and_b(cf: int, cb: int) -> Action:
            fa, ba = f(cf), b(cb)
            return Action(Kind.FB, fa.stage, fa.mb, b_stage=ba.stage, b_mb=ba.mb)

        acts += [f(0) for _ in range(2 * (pp - r - 1))]
        for _ in range(r + 1):
            acts += [f(0), f(1)]
        for _ in range(pp - r - 1):
            acts += [b(1, split=True), w(), f(1)]
        for i in range(m - 2 * pp + r + 1):
            # the bottom of the V runs its first pair unoverlapped: F0 feeds F1 on the same rank
            acts += [f(0), b(1)] if i == 0 and r == pp - 1 else [f_and_b(0, 1)]
            acts.append(f_and_b(1, 0))
        for _ in range(pp - r - 1):
            acts += [b(1), f_and_b(1, 0)]
        split = False
        for i in range(r + 1):
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            acts.append(b(1, split))
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            acts.append(b(0, split))
        for _ in range(pp - r - 1):
            acts += [w(), b(0, split=True)]
        acts += [w() for _ in range(len(weights))]
        ranks.append(acts)
    return ranks
