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
K/V rotate again exactly as forward; the partial dK_j, dV_j (fp32) of step i >= 1 travel one hop
behind them, collecting every rank's contribution, and reach their owner after step n-1, where they
are added to its own step-0 part. Block math is in fp32. On CPU, when q and v have the same head
width, each block runs torch's CPU flash kernel (forward returns O_i and L_i; backward takes the merged
O and L, as FlashAttention-based rings do), which is tiled: no (rows x keys) score block is ever
materialised, so a rank's memory grows with s/n, not (s/n)^2. Otherwise (MLA's dv != d, or another
device) the same math runs as einsums, GQA by grouping query heads.
"""
from __future__ import annotations

import torch

from fivefold.runtime import comm, traffic
from fivefold.runtime.mesh import Group


def _grouped(q: torch.Tensor, g: int) -> torch.Tensor:
    """(b, a, s, d) -> (b, g, a/g, s, d): query head i reads KV head i // (a/g)."""
    b, a, s, d = q.shape
    return q.view(b, g, a // g, s, d)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """q (b, g, m, rq, d), k (b, g, rk, d) fp32 -> scores (b, g, m, rq, rk), -inf above the diagonal if causal."""
    s = torch.einsum("bgmqd,bgkd->bgmqk", q, k) * scale
    if causal:
        rq, rk = s.shape[-2:]
        s = s.masked_fill(torch.ones(rq, rk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _flash(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether torch's CPU flash kernel serves a block (it needs equal q/k/v head widths)."""
    return q.device.type == "cpu" and q.shape[-1] == v.shape[-1]


def _per_query_head(t: torch.Tensor, a: int) -> torch.Tensor:
    """(b, g, rk, d) -> (b, a, rk, d) fp32: each KV head repeated for its a/g query heads (as repeat_kv)."""
    return t.float().repeat_interleave(a // t.shape[1], dim=1)


def block_forward(q, k, v, scale: float, causal: bool):
    """Partial attention of one block: q (b, a, rq, d), k (b, g, rk, d), v (b, g, rk, dv) ->
    O (b, a, rq, dv) fp32 and L (b, a, rq) fp32."""
    b, a, rq, _ = q.shape
    g = k.shape[1]
    if _flash(q, v):
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.float(), _per_query_head(k, a), _per_query_head(v, a), 0.0, causal, attn_mask=None, scale=scale)
        return o, lse
    s = _scores(_grouped(q.float(), g), k.float(), scale, causal)  # (b, g, a/g, rq, rk)
    lse = torch.logsumexp(s, dim=-1)  # (b, g, a/g, rq)
    o = torch.einsum("bgmqk,bgkd->bgmqd", torch.exp(s - lse.unsqueeze(-1)), v.float())  # (b, g, a/g, rq, dv)
    return o.reshape(b, a, rq, -1), lse.reshape(b, a, rq)


def block_backward(q, k, v, do, out, lse, delta, scale: float, causal: bool):
    """Gradients of one block from the merged O, L and D = rowsum(dO * O):
    returns dq (b, a, rq, d), dk (b, g, rk, d), dv (b, g, rk, dv), all fp32."""
    b, a, rq, _ = q.shape
    g = k.shape[1]
    if _flash(q, v):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q.float(), _per_query_head(k, a), _per_query_head(v, a), out, lse, 0.0, causal,
            attn_mask=None, scale=scale)
        rk = k.shape[2]
        return dq, dk.view(b, g, a // g, rk, -1).sum(2), dv.view(b, g, a // g, rk, -1).sum(2)
    qg, dog = _grouped(q.float(), g), _grouped(do, g)  # (b, g, a/g, rq, d|dv)
    s = _scores(qg, k.float(), scale, causal)
    p = torch.exp(s - _grouped(lse.unsqueeze(-1), g))  # (b, g, a/g, rq, rk); masked entries exp(-inf) = 0
    dv = torch.einsum("bgmqk,bgmqd->bgkd", p, dog)
    dp = torch.einsum("bgmqd,bgkd->bgmqk", dog, v.float())
    ds = p * (dp - _grouped(delta.unsqueeze(-1), g))
    dq = torch.einsum("bgmqk,bgkd->bgmqd", ds, k.float()) * scale
    dk = torch.einsum("bgmqk,bgmqd->bgkd", ds, qg) * scale
    return dq.reshape(b, a, rq, -1), dk, dv


def _block(i: int, r: int, n: int, c: int) -> tuple[slice, slice, bool]:
    """(query rows, key columns, causal) of step i on ring rank r (chunks of c tokens)."""
    j = (r - i) % n
    if i == 0:
        return slice(None), slice(None), True
    if j < r:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


def _exchange(tensors: list[torch.Tensor], ring: Group, tag: str):
    """Post: send each tensor to ring rank r+1, receive same-shaped ones from r-1. -> (buffers, works)."""
    nxt, prev = ring.global_rank((ring.rank + 1) % ring.size), ring.global_rank((ring.rank - 1) % ring.size)
    bufs = [torch.empty_like(t) for t in tensors]
    works = comm.send_recv([(t, nxt) for t in tensors], [(t, prev) for t in bufs], tag)
    return bufs, works


def _wait(works) -> None:
    for w in works:
        w.wait()


class RingAttention(torch.autograd.Function):
    """Causal attention over the ring's load-balanced chunks (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Group, tag: str, scale: float):
        with torch.autocast(q.device.type, enabled=False):  # the block math is fp32 whatever the caller's autocast
            return RingAttention._forward(ctx, q, k, v, ring, tag, scale)

    @staticmethod
    def _forward(ctx, q, k, v, ring: Group, tag: str, scale: float):
        n, r, c = ring.size, ring.rank, q.shape[2] // 2
        out = q.new_zeros((*q.shape[:3], v.shape[-1]), dtype=torch.float32)  # (b, a, s_loc, dv)
        lse = q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)  # (b, a, s_loc)
        kv = [k.contiguous(), v.contiguous()]
        for i in range(n):
            nxt = _exchange(kv, ring, tag) if i < n - 1 else None  # next block in flight during this one
            rows, cols, causal = _block(i, r, n, c)
            with traffic.span("compute", tag):
                o_i, l_i = block_forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], scale, causal)
            new = torch.logaddexp(lse[:, :, rows], l_i)
            out[:, :, rows] = out[:, :, rows] * torch.exp(lse[:, :, rows] - new).unsqueeze(-1) \
                + o_i * torch.exp(l_i - new).unsqueeze(-1)
            lse[:, :, rows] = new
            if nxt is not None:
                _wait(nxt[1])
                kv = nxt[0]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.tag, ctx.scale = ring, tag, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        with torch.autocast(do.device.type, enabled=False):
            return RingAttention._backward(ctx, do)

    @staticmethod
    def _backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        ring, tag, scale = ctx.ring, ctx.tag, ctx.scale
        n, r, c = ring.size, ring.rank, q.shape[2] // 2
        do = do.float()
        delta = (do * out).sum(-1)  # (b, a, s_loc): D = rowsum(dO * O)
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = [k.contiguous(), v.contiguous()]
        own = travelling = None
        for i in range(n):
            nxt = _exchange(kv, ring, tag) if i < n - 1 else None
            rows, cols, causal = _block(i, r, n, c)
            with traffic.span("compute", tag):
                dq_i, dk_i, dv_i = block_backward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                                  do[:, :, rows], out[:, :, rows], lse[:, :, rows], delta[:, :, rows],
                                                  scale, causal)
            dq[:, :, rows] += dq_i
            dkv = [torch.zeros_like(kv[0], dtype=torch.float32), torch.zeros_like(kv[1], dtype=torch.float32)]
            dkv[0][:, :, cols] += dk_i
            dkv[1][:, :, cols] += dv_i
            if i == 0:
                own = dkv
            else:  # add what earlier ranks gave this K/V, pass it on one hop behind the K/V
                if travelling is not None:
                    _wait(travelling[1])
                    dkv = [a + b for a, b in zip(dkv, travelling[0])]
                travelling = _exchange(dkv, ring, tag)
            if nxt is not None:
                _wait(nxt[1])
                kv = nxt[0]
        if travelling is not None:  # after step n-1: the sum of every other rank's part of our own K/V
            _wait(travelling[1])
            own = [a + b for a, b in zip(own, travelling[0])]
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Group, *, tag: str = "cp",
                   scale: float | None = None) -> torch.Tensor:
    """q (b, a, s_loc, d), k (b, g, s_loc, d), v (b, g, s_loc, dv) of this ring rank's two chunks ->
    (b, a, s_loc, dv): causal attention over the whole sequence (a % g == 0; scale default 1/sqrt(d))."""
    if q.shape[2] % 2:
        raise ValueError(f"ring attention needs an even local sequence (two chunks), got {q.shape[2]}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingAttention.apply(q, k, v, ring, tag, scale)
