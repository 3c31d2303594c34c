"""Ring attention over load-balanced chunks (cp_comm_type p2p), forward and backward.

Ring rank r of n holds Q, K, V for chunks r and 2n-1-r of a 2n split of the sequence (c tokens
each; local order [chunk r, chunk 2n-1-r] is increasing in global position). At step i it holds
the K/V of rank j = (r - i) mod n and attends:
  i = 0  (j = r): all local queries, all local keys, causal in local order (the two diagonal blocks,
                  and chunk 2n-1-r seeing chunk r in full);
  j < r:          all queries, the first half of j's keys (chunk j, earlier than both of ours), full;
                  j's second chunk 2n-1-j is later than both of ours: skipped;
  j > r:          the second half of our queries (chunk 2n-1-r) against all of j's keys, full;
                  our chunk r is earlier than both of j's chunks: skipped.
(TransformerEngine's half-block scheme: every step after the first costs half a block.)

Each block gives a partial output O_i and log-sum-exp L_i = log sum_k exp(s_qk) of its rows; they
merge exactly as online softmax:  L = logaddexp(L, L_i),  O = O exp(L_old - L) + O_i exp(L_i - L).
K/V travel in pieces (`ring_pieces`: m pieces of s_loc/m tokens per rank, each chunk cut into m/2)
as a wavefront: at tick t a rank sends its own piece t and forwards every piece it received at tick
t-1, so piece p of the K/V of rank r-i arrives at tick i+p-1 and is computed at tick i+p while the
next tick's pieces are in flight (communication overlaps compute; each tick's work is a "compute"
span in traffic.events). A rank holds only the pieces of two ticks (at most 2(n-1) pieces), never a
whole foreign K/V. Step 0 (the rank's own causal block) runs in tick 0.

Backward (RingAttention.backward), from the saved q, k, v, merged O and L only: with
D = rowsum(dO * O), each block recomputes P = exp(q k^T * scale - L) and gives
  dV_j += P^T dO,  dS = P * (dO V_j^T - D),  dQ += dS K_j * scale,  dK_j += dS^T Q * scale.
K/V travel again exactly as forward; the partial dK_j, dV_j of each piece (fp32, piece-sized)
travel one tick behind it, each rank adding its part to what arrived, and reach their owner one hop
after the last rank that uses the piece, where they are added to its own step-0 part.

Memory (the block math is fivefold.ops.attention): blocks run in
the compute dtype with the kernels' own tiling, GQA K/V as they are (no copy per query head); only
the merged O and L, dQ and the travelling dK/dV pieces are fp32 (for an fp32 run O, dQ and the own
dK/dV are the kernels' outputs, not copies); the merge works in place; query rows of a remote piece
go through the kernel in `ROW_TILES` tiles so its dQ temporary stays small. Per rank, beyond what one
process of s/n tokens holds (O, dQ, dK, dV), the extra is a few pieces per ring rank:
docs/context_parallel.md gives the formula that benchmarks/cp_attention.py checks.

Documents (`docs`, global boundaries): every block is cut into each document's rows x columns
(`Documents.pieces` from the blocks' global positions); rows whose document has no key in a block
get nothing from it (L = -inf, merged as exp(-inf) = 0). Step 0 gives every row at least itself.
"""
from __future__ import annotations

import torch

from fivefold.ops.attention import Documents, block_backward, block_forward
from fivefold.planner.memory.cp_memory import ROW_TILES, ring_pieces
from fivefold.runtime import comm, traffic
from fivefold.runtime.mesh import Group


def _block(i: int, r: int, n: int, c: int) -> tuple[slice, slice, bool]:
    """(query rows, key columns, causal) of step i on ring rank r (chunks of c tokens)."""
    j = (r - i) % n
    if i == 0:
        return slice(None), slice(None), True
    if j < r:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


def _tiles(start: int, stop: int, k: int) -> list[tuple[int, int]]:
    """[start, stop) cut into at most k near-equal ranges."""
    k = max(1, min(k, stop - start))
    cuts = [start + (stop - start) * t // k for t in range(k + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


class _Geometry:
    """Where piece p of ring rank j's K/V sits, and which query rows of this rank it meets."""

    def __init__(self, ring: Group, s_loc: int, m: int, docs: Documents | None):
        self.n, self.r, self.s_loc, self.m, self.docs = ring.size, ring.rank, s_loc, m, docs
        self.c, self.w = s_loc // 2, s_loc // m

    def keys(self, p: int) -> slice:
        return slice(p * self.w, (p + 1) * self.w)

    def tiles(self, i: int, p: int) -> list[tuple[int, int, list | None]]:
        """(row start, row stop, document pieces) of each kernel call for piece p of step i's K/V;
        empty when the step does not use that piece."""
        rows, cols, _ = _block(i, self.r, self.n, self.c)
        if cols.stop is not None and p * self.w >= cols.stop:
            return []  # the second chunk of an earlier rank: later than all our queries
        start = 0 if rows.start is None else rows.start
        out = []
        for a, b in _tiles(start, self.s_loc, ROW_TILES):
            out.append((a, b, self._doc_pieces(i, p, a, b)))
        return [t for t in out if t[2] is None or t[2]]

    def positions(self, j: int) -> torch.Tensor:
        """Global positions of ring rank j's tokens: chunks j and 2n-1-j of c tokens."""
        c, n = self.c, self.n
        return torch.cat([torch.arange(j * c, (j + 1) * c), torch.arange((2 * n - 1 - j) * c, (2 * n - j) * c)])

    def _doc_pieces(self, i: int, p: int, a: int, b: int):
        if self.docs is None:
            return None
        k_pos = self.positions((self.r - i) % self.n)[self.keys(p)]
        return self.docs.pieces(self.positions(self.r)[a:b], k_pos, causal=False)

    def own_pieces(self):
        """Document pieces of step 0's causal block (None without documents)."""
        if self.docs is None:
            return None
        pos = self.positions(self.r)
        return self.docs.pieces(pos, pos, causal=True)

    def kv_recv(self, t: int) -> list[tuple[int, int]]:
        """(step i, piece p) of the K/V pieces received at tick t: piece p of rank r-i arrives at i+p-1."""
        return [(i, t + 1 - i) for i in range(1, self.n) if 0 <= t + 1 - i < self.m]

    def dkv_recv(self, t: int) -> list[tuple[int, int]]:
        """dK/dV partials received at tick t for pieces (i, p) computed here at tick t (i >= 2), and
        with i = n the finished sum for this rank's own piece p."""
        return [(i, t - i) for i in range(2, self.n + 1) if 0 <= t - i < self.m]


def _ring_peers(ring: Group) -> tuple[int, int]:
    return ring.global_rank((ring.rank + 1) % ring.size), ring.global_rank((ring.rank - 1) % ring.size)


def _post(sends: list[torch.Tensor], recvs: list[torch.Tensor], ring: Group, tag: str):
    if not sends and not recvs:
        return []
    nxt, prev = _ring_peers(ring)
    return comm.send_recv([(t, nxt) for t in sends], [(t, prev) for t in recvs], tag)


def _wait(works) -> None:
    for w in works:
        w.wait()


def merge_(out: torch.Tensor, lse: torch.Tensor, o_i: torch.Tensor, l_i: torch.Tensor) -> None:
    """In place: L = logaddexp(L, L_i), O = O exp(L_old - L) + O_i exp(L_i - L) (out, lse fp32 views).
    Rows with L_i = -inf (no key of their document in the block) keep O and L: exp(-inf) = 0."""
    new = torch.logaddexp(lse, l_i)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(o_i.float().mul_(torch.exp(l_i - new).unsqueeze(-1)))
    lse.copy_(new)


def _piece(t: torch.Tensor, keys: slice) -> torch.Tensor:
    """A contiguous copy of K or V's piece (what p2p sends)."""
    return t[:, :, keys].contiguous()


class RingAttention(torch.autograd.Function):
    """Causal attention over the ring's load-balanced chunks (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Group, tag: str, scale: float, docs: Documents | None, m: int):
        with torch.autocast(q.device.type, enabled=False):  # blocks in q's dtype whatever the caller's autocast
            return RingAttention._forward(ctx, q, k, v, ring, tag, scale, docs, m)

    @staticmethod
    def _forward(ctx, q, k, v, ring: Group, tag: str, scale: float, docs, m: int):
        geo = _Geometry(ring, q.shape[2], m, docs)
        n = ring.size
        out = lse = None
        held: dict[tuple[int, int], list[torch.Tensor]] = {}
        for t in range(n + m - 1):
            sends = ([_piece(k, geo.keys(t)), _piece(v, geo.keys(t))] if t < m and n > 1 else [])
            sends += [x for (i, p), kv in sorted(held.items()) if i <= n - 2 for x in kv]
            got = geo.kv_recv(t)
            bufs = [[k.new_empty((*k.shape[:2], geo.w, k.shape[-1])), v.new_empty((*v.shape[:2], geo.w, v.shape[-1]))]
                    for _ in got]
            works = _post(sends, [x for kv in bufs for x in kv], ring, tag)
            del sends
            with traffic.span("compute", tag):
                if t == 0:  # step 0: our own causal block; the kernel's output is the fp32 accumulator
                    o0, lse = block_forward(q, k, v, scale, True, geo.own_pieces())
                    out = o0.float()
                    del o0
                for (i, p), (kp, vp) in sorted(held.items()):
                    for a, b, pieces in geo.tiles(i, p):
                        o_t, l_t = block_forward(q[:, :, a:b], kp, vp, scale, False, pieces)
                        merge_(out[:, :, a:b], lse[:, :, a:b], o_t, l_t)
                        del o_t, l_t
            _wait(works)
            del works  # the sent pieces are free once their sends are done
            held = dict(zip(got, bufs))
            del bufs
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.tag, ctx.scale, ctx.docs, ctx.m = ring, tag, scale, docs, m
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        with torch.autocast(do.device.type, enabled=False):
            return RingAttention._backward(ctx, do)

    @staticmethod
    def _backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        ring, tag, scale, m = ctx.ring, ctx.tag, ctx.scale, ctx.m
        geo = _Geometry(ring, q.shape[2], m, ctx.docs)
        n = ring.size
        do = do.to(q.dtype)
        out_c = out.to(q.dtype)  # the kernels take O in the compute dtype (no copy in fp32)
        dq = own = None
        held: dict[tuple[int, int], list[torch.Tensor]] = {}
        ready: dict[tuple[int, int], list[torch.Tensor]] = {}  # dK/dV partials to send this tick
        for t in range(n + m):
            sends = ([_piece(k, geo.keys(t)), _piece(v, geo.keys(t))] if t < m and n > 1 else [])
            sends += [x for (i, p), kv in sorted(held.items()) if i <= n - 2 for x in kv]
            sends += [x for _, dkv in sorted(ready.items()) for x in dkv]
            got, got_dkv = geo.kv_recv(t), geo.dkv_recv(t)
            bufs = [[k.new_empty((*k.shape[:2], geo.w, k.shape[-1])), v.new_empty((*v.shape[:2], geo.w, v.shape[-1]))]
                    for _ in got]
            dbufs = [[k.new_empty((*k.shape[:2], geo.w, k.shape[-1]), dtype=torch.float32),
                      v.new_empty((*v.shape[:2], geo.w, v.shape[-1]), dtype=torch.float32)] for _ in got_dkv]
            works = _post(sends, [x for kv in bufs + dbufs for x in kv], ring, tag)
            del sends
            ready = {}
            with traffic.span("compute", tag):
                if t == 0:  # step 0: dQ and our own dK/dV come out of the kernel as the accumulators
                    dq, dk, dv = block_backward(do, q, k, v, out_c, lse, scale, True, geo.own_pieces())
                    dq, own = dq.float(), [dk.float(), dv.float()]
                    del dk, dv
                for (i, p), (kp, vp) in sorted(held.items()):
                    dkv = [torch.zeros(kp.shape, dtype=torch.float32, device=kp.device),
                           torch.zeros(vp.shape, dtype=torch.float32, device=vp.device)]
                    for a, b, pieces in geo.tiles(i, p):
                        dq_t, dk_t, dv_t = block_backward(do[:, :, a:b], q[:, :, a:b], kp, vp, out_c[:, :, a:b],
                                                          lse[:, :, a:b], scale, False, pieces)
                        dq[:, :, a:b] += dq_t
                        dkv[0] += dk_t
                        dkv[1] += dv_t
                        del dq_t, dk_t, dv_t
                    ready[i, p] = dkv
            _wait(works)
            del works  # the sent pieces are free once their sends are done
            held = dict(zip(got, bufs))
            for (i, p), (dk_in, dv_in) in zip(got_dkv, dbufs):
                if i == n:  # every other rank's part of our own piece p
                    own[0][:, :, geo.keys(p)] += dk_in
                    own[1][:, :, geo.keys(p)] += dv_in
                else:  # add what the ranks before gave this piece; it goes on next tick
                    ready[i, p][0] += dk_in
                    ready[i, p][1] += dv_in
            del bufs, dbufs
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Group, *, tag: str = "cp",
                   scale: float | None = None, docs: Documents | None = None, pieces: int | None = None
                   ) -> torch.Tensor:
    """q (b, a, s_loc, d), k (b, g, s_loc, d), v (b, g, s_loc, dv) of this ring rank's two chunks ->
    (b, a, s_loc, dv): causal attention over the whole sequence (a % g == 0; scale default 1/sqrt(d));
    with `docs` (global boundaries of the s_loc * ring.size tokens) each document attends to itself.
    `pieces`: how many pieces the K/V travel in (default `ring_pieces(s_loc)`; even, dividing s_loc)."""
    s_loc = q.shape[2]
    if s_loc % 2:
        raise ValueError(f"ring attention needs an even local sequence (two chunks), got {s_loc}")
    m = ring_pieces(s_loc) if pieces is None else pieces
    if m % 2 or (s_loc // 2) % (m // 2):
        raise ValueError(f"ring attention: {m} pieces must be even and cut each chunk of {s_loc // 2} evenly")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingAttention.apply(q, k, v, ring, tag, scale, docs, m)
