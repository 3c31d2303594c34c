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
The next K/V is posted (send to r+1, receive from r-1, tag "cp") before the current block is
computed, so communication overlaps compute (each block is a "compute" span in traffic.events).

Backward (RingAttention.backward), from the saved q, k, v, merged O and L only: with
D = rowsum(dO * O), each block recomputes P = exp(q k^T * scale - L) and gives
  dV_j += P^T dO,  dS = P * (dO V_j^T - D),  dQ += dS K_j * scale,  dK_j += dS^T Q * scale.
K/V rotate again exactly as forward; the partial dK_j, dV_j of step i >= 1 travel one hop
behind them, collecting every rank's contribution, and reach their owner after step n-1, where they
are added to its own step-0 part.

Memory (fivefold.ops.attention does the block math): blocks run in the compute dtype with
the kernels' own tiling (no (rows x keys) score block), GQA K/V as they are (no copy per query head);
only the merged O and L, dQ and the travelling dK/dV are fp32 (for an fp32 run they are the kernel's
outputs themselves, not copies). K/V arrive in two receive buffers that alternate (one when n = 2),
the travelling dK/dV likewise, and the merge works in place. docs/context_parallel.md gives the
per-rank formula that benchmarks/cp_attention.py checks.

Documents (`docs`, global boundaries): every block is cut into each document's rows x columns
(`Documents.pieces` from the blocks' global positions); rows whose document has no key in a block
get nothing from it (L = -inf, merged as exp(-inf) = 0). Step 0 gives every row at least itself.
"""
from __future__ import annotations

import torch

from fivefold.ops.attention import Documents, block_backward, block_forward
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


class _Hop:
    """Tensors passed one hop along the ring (send to rank r+1, receive from r-1) into two receive
    buffer sets used in turn: the set received two hops ago has been read and its send waited for."""

    def __init__(self, ring: Group, tag: str):
        self.ring, self.tag = ring, tag
        self.slots: list[list[torch.Tensor] | None] = [None, None]
        self.turn = 0

    def post(self, tensors: list[torch.Tensor]):
        """-> (receive buffers, works); wait for the works before reading the buffers or reposting."""
        ring = self.ring
        nxt, prev = ring.global_rank((ring.rank + 1) % ring.size), ring.global_rank((ring.rank - 1) % ring.size)
        slot = self.slots[self.turn]
        if slot is None or [t.shape for t in slot] != [t.shape for t in tensors]:
            slot = self.slots[self.turn] = [_new_like(t) for t in tensors]
        self.turn ^= 1
        works = comm.send_recv([(_wire(t), nxt) for t in tensors], [(_wire(t), prev) for t in slot], self.tag)
        return slot, works

    def release(self) -> None:
        self.slots = [None, None]


def _seq_major(shape, like: torch.Tensor, zero: bool = False) -> torch.Tensor:
    """A (b, h, s, d) tensor stored as (b, s, h, d): the layout the kernels give gradients in, and
    the one dK/dV travel in (every rank must agree on it)."""
    b, h, s, d = shape
    make = torch.zeros if zero else torch.empty
    return make((b, s, h, d), dtype=torch.float32, device=like.device).transpose(1, 2)


def _as_seq_major(t: torch.Tensor) -> torch.Tensor:
    """t (b, h, s, d) in fp32 and the travelling layout: itself when it already is, else a copy."""
    if t.dtype == torch.float32 and t.transpose(1, 2).is_contiguous():
        return t
    out = _seq_major(t.shape, t)
    out.copy_(t)
    return out


def _wire(t: torch.Tensor) -> torch.Tensor:
    """The contiguous view p2p sends and receives: t itself, or its seq-major storage (b, s, h, d)."""
    return t if t.is_contiguous() else t.transpose(1, 2)


def _new_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t) if t.is_contiguous() else _seq_major(t.shape, t).to(t.dtype)


def _wait(works) -> None:
    for w in works:
        w.wait()


def _merge_(out: torch.Tensor, lse: torch.Tensor, o_i: torch.Tensor, l_i: torch.Tensor) -> None:
    """In place: L = logaddexp(L, L_i), O = O exp(L_old - L) + O_i exp(L_i - L) (out, lse fp32 views)."""
    new = torch.logaddexp(lse, l_i)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(o_i.float().mul_(torch.exp(l_i - new).unsqueeze(-1)))
    lse.copy_(new)


def _pieces(docs: Documents | None, i: int, r: int, n: int, s_loc: int, rows: slice, cols: slice, causal: bool):
    """The document pieces of step i's block (None without documents)."""
    if docs is None:
        return None
    from fivefold.parallel.context import local_positions
    q_pos = local_positions(s_loc, n, r)[rows]
    k_pos = local_positions(s_loc, n, (r - i) % n)[cols]
    return docs.pieces(q_pos, k_pos, causal)


class RingAttention(torch.autograd.Function):
    """Causal attention over the ring's load-balanced chunks (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Group, tag: str, scale: float, docs: Documents | None):
        with torch.autocast(q.device.type, enabled=False):  # blocks in q's dtype whatever the caller's autocast
            return RingAttention._forward(ctx, q, k, v, ring, tag, scale, docs)

    @staticmethod
    def _forward(ctx, q, k, v, ring: Group, tag: str, scale: float, docs):
        n, r, s_loc = ring.size, ring.rank, q.shape[2]
        c = s_loc // 2
        hop = _Hop(ring, tag)
        kv = [k.contiguous(), v.contiguous()]
        out = lse = None
        for i in range(n):
            nxt = hop.post(kv) if i < n - 1 else None  # next block in flight during this one
            rows, cols, causal = _block(i, r, n, c)
            with traffic.span("compute", tag):
                o_i, l_i = block_forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], scale, causal,
                                         _pieces(docs, i, r, n, s_loc, rows, cols, causal))
            if i == 0:  # every row: the kernel's own output is the fp32 accumulator (a copy only in bf16/fp16)
                out, lse = o_i.float(), l_i
            else:
                _merge_(out[:, :, rows], lse[:, :, rows], o_i, l_i)
            del o_i, l_i
            if nxt is not None:
                _wait(nxt[1])
                kv = nxt[0]
        del kv
        hop.release()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.tag, ctx.scale, ctx.docs = ring, tag, scale, docs
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        with torch.autocast(do.device.type, enabled=False):
            return RingAttention._backward(ctx, do)

    @staticmethod
    def _backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        ring, tag, scale, docs = ctx.ring, ctx.tag, ctx.scale, ctx.docs
        n, r, s_loc = ring.size, ring.rank, q.shape[2]
        c = s_loc // 2
        do = do.to(q.dtype)
        out_c = out.to(q.dtype)  # the kernels take O in the compute dtype (no copy in fp32)
        kv_hop, dkv_hop = _Hop(ring, tag), _Hop(ring, tag)
        kv = [k.contiguous(), v.contiguous()]
        dq = own = travelling = None
        for i in range(n):
            nxt = kv_hop.post(kv) if i < n - 1 else None
            rows, cols, causal = _block(i, r, n, c)
            with traffic.span("compute", tag):
                dq_i, dk_i, dv_i = block_backward(do[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                                  out_c[:, :, rows], lse[:, :, rows], scale, causal,
                                                  _pieces(docs, i, r, n, s_loc, rows, cols, causal))
            if nxt is None:  # the last block is done with K/V: free the buffers before dK/dV travel
                del kv
                kv_hop.release()
            if i == 0:
                dq, own = dq_i.float(), [dk_i.float(), dv_i.float()]
            else:  # add what earlier ranks gave this K/V, pass it on one hop behind the K/V
                dq[:, :, rows] += dq_i
                if travelling is not None:
                    _wait(travelling[1])
                    acc = travelling[0]
                    acc[0][:, :, cols] += dk_i
                    acc[1][:, :, cols] += dv_i
                elif cols == slice(None):  # the first contribution covers every key: it is the accumulator
                    acc = [_as_seq_major(dk_i), _as_seq_major(dv_i)]
                else:
                    acc = [_seq_major((*t.shape[:2], s_loc, t.shape[-1]), t, zero=True) for t in (dk_i, dv_i)]
                    acc[0][:, :, cols] += dk_i
                    acc[1][:, :, cols] += dv_i
                del dk_i, dv_i
                travelling = dkv_hop.post(acc)
                del acc
            del dq_i
            if nxt is not None:
                _wait(nxt[1])
                kv = nxt[0]
        if travelling is not None:  # after step n-1: the sum of every other rank's part of our own K/V
            _wait(travelling[1])
            own[0] += travelling[0][0]
            own[1] += travelling[0][1]
            del travelling
            dkv_hop.release()
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Group, *, tag: str = "cp",
                   scale: float | None = None, docs: Documents | None = None) -> torch.Tensor:
    """q (b, a, s_loc, d), k (b, g, s_loc, d), v (b, g, s_loc, dv) of this ring rank's two chunks ->
    (b, a, s_loc, dv): causal attention over the whole sequence (a % g == 0; scale default 1/sqrt(d));
    with `docs` (global boundaries of the s_loc * ring.size tokens) each document attends to itself."""
    if q.shape[2] % 2:
        raise ValueError(f"ring attention needs an even local sequence (two chunks), got {q.shape[2]}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingAttention.apply(q, k, v, ring, tag, scale, docs)
