"""The attention kernels, behind one interface: causal softmax(q k^T * scale) v, GQA unexpanded.

    q (b, a, s_q, d), k (b, g, s_k, d), v (b, g, s_k, dv), a % g == 0 (query head i reads KV head
    i // (a/g)), in the compute dtype  ->  O (b, a, s_q, dv) and, for callers that merge blocks
    (ring attention), the log-sum-exp L (b, a, s_q) fp32 of each row's scores.

Two entry points:
  `attention`        differentiable (autograd), the whole causal sequence, optional `Documents`.
  `block_forward` /  one block of a ring step, no autograd: the forward gives O_i and L_i; the
  `block_backward`   backward takes the *merged* O and L (FlashAttention's rule: with them, the
                     block's P = exp(q k^T * scale - L) is exact) and gives dq, dk, dv.

Kernels, chosen per device, dtype and shape:
  CPU   `aten._scaled_dot_product_flash_attention_for_cpu` (tiled, returns L, takes GQA as is) and its
        backward; documents by one call per document piece (the op refuses bool masks, and a float
        mask would materialise a (s_q x s_k) block and gives fully masked rows L = 0, not -inf).
  CUDA  `F.scaled_dot_product_attention` picks flash / memory-efficient / cuDNN for the
        differentiable path; blocks use the memory-efficient op (`compute_log_sumexp`, any dtype);
        documents use `torch.nn.attention.varlen` (fp16/bf16, L via AuxRequest(lse=True), causal as
        window (-1, 0)) when it exists, else per-document calls. Kernels that want equal head counts
        get them by looping over the a/g query heads of each KV head (`_per_group`): K/V are never
        copied per query head.
MLA's dv != d: the narrower of V and Q/K is zero-padded to the wider width w = max(d, dv) and the
results sliced back (zero columns of q and k add 0 to every score; zero columns of V give zero
columns of O), with the scale fixed at 1/sqrt(d) beforehand: exact, and no separate math path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

Piece = tuple[int, int, int, int, int, bool]
"""(batch row, q start, q end, k start, k end, causal): one document's share of a block."""


@dataclass(frozen=True)
class Documents:
    """Where the documents of a packed batch start: `bounds[row] = (0, e_1, ..., s)`, each
    document [e_i, e_{i+1}) attending only to itself (causally). Python ints: the kernel loop and
    the varlen offsets need them on the host, once per batch."""

    bounds: tuple[tuple[int, ...], ...]

    @staticmethod
    def from_starts(starts: torch.Tensor) -> Documents:
        """starts (b, s) bool, True where a document begins (position 0 is always a start)."""
        s = starts.shape[1]
        rows = []
        for row in starts.cpu():
            cut = sorted({0, *row.nonzero().flatten().tolist()})
            rows.append(tuple(cut) + (s,))
        return Documents(tuple(rows))

    @property
    def seq_len(self) -> int:
        return self.bounds[0][-1]

    def padded_to(self, s: int) -> Documents:
        """The same documents in a batch right-padded to s tokens: the padding joins each row's last
        document (after its real tokens, so causal attention keeps it out of them)."""
        if s == self.seq_len:
            return self
        return Documents(tuple(cuts[:-1] + (s,) for cuts in self.bounds))

    def pieces(self, q_pos: torch.Tensor | None = None, k_pos: torch.Tensor | None = None,
               causal: bool = True) -> list[Piece]:
        """Each document's rows and columns of a block whose queries / keys sit at the increasing
        global positions q_pos / k_pos (None: 0..s-1). A document whose keys or queries are not in
        the block gives no piece: its rows get nothing from this block."""
        out = []
        for b, cuts in enumerate(self.bounds):
            cuts_t = torch.tensor(cuts)
            qc = _cuts(q_pos, cuts_t, cuts)
            kc = _cuts(k_pos, cuts_t, cuts)
            for i in range(len(cuts) - 1):
                if qc[i] < qc[i + 1] and kc[i] < kc[i + 1]:
                    out.append((b, qc[i], qc[i + 1], kc[i], kc[i + 1], causal))
        return out


def _cuts(pos: torch.Tensor | None, cuts_t: torch.Tensor, cuts: tuple[int, ...]) -> list[int]:
    """Local index where each document starts among increasing positions `pos`."""
    if pos is None:
        return list(cuts)
    return torch.searchsorted(pos.cpu(), cuts_t).tolist()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
              docs: Documents | None = None) -> torch.Tensor:
    """Causal attention of the whole sequence, differentiable: (b, a, s, d), (b, g, s, d),
    (b, g, s, dv) -> (b, a, s, dv); with `docs`, each document attends only to itself."""
    d, dv = q.shape[-1], v.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    q, k, v = _widen(q, k, v)
    if docs is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    elif (varlen := _varlen_args(q, k)) is not None:
        o = _varlen(q, k, v, docs, scale, varlen)
    else:  # one call per document; cat along the sequence keeps autograd plain
        rows = []
        for b, cuts in enumerate(docs.bounds):
            rows.append(torch.cat([
                F.scaled_dot_product_attention(q[b:b + 1, :, s0:s1], k[b:b + 1, :, s0:s1], v[b:b + 1, :, s0:s1],
                                               is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
                for s0, s1 in zip(cuts[:-1], cuts[1:])], dim=2))
        o = torch.cat(rows, dim=0)
    return o[..., :dv]


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """Causal attention of the last s_q positions over all s_k >= s_q keys (decoding with a KV
    cache: query i sits at position s_k - s_q + i and sees keys 0 .. s_k - s_q + i), forward-only:
    (b, a, s_q, d), (b, g, s_k, d), (b, g, s_k, dv) -> (b, a, s_q, dv)."""
    s_q, s_k = q.shape[2], k.shape[2]
    if s_q == s_k:
        return attention(q, k, v, scale=scale)
    sees = torch.arange(s_k, device=q.device) <= torch.arange(s_k - s_q, s_k, device=q.device)[:, None]  # (s_q, s_k)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=sees, scale=q.shape[-1] ** -0.5 if scale is None else scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _pad_to(t: torch.Tensor, w: int) -> torch.Tensor:
    """t (.., x) -> (.., w) with zero columns; the kernels want q, k and v equally wide."""
    return t if t.shape[-1] == w else F.pad(t, (0, w - t.shape[-1]))


def _widen(*ts: torch.Tensor) -> list[torch.Tensor]:
    """Every tensor zero-padded to the widest last dimension among them (dv != d, MLA)."""
    w = max(t.shape[-1] for t in ts)
    return [_pad_to(t, w) for t in ts]


def _varlen_args(q: torch.Tensor, k: torch.Tensor) -> dict | None:
    """The causal / GQA keywords this torch's varlen_attn takes, or None where it cannot serve (not
    CUDA fp16/bf16, no torch.nn.attention.varlen, or GQA without enable_gqa): then per-document calls."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    args = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" not in params:
            return None
        args["enable_gqa"] = True
    return args


def _varlen(q, k, v, docs: Documents, scale, args: dict):
    """CUDA: the batch as one packed (b*s, heads, d) sequence with document offsets cu_seqlens."""
    from torch.nn.attention.varlen import varlen_attn
    b, a, s, d = q.shape
    cu = torch.tensor([r * s + c for r, cuts in enumerate(docs.bounds) for c in cuts[:-1]] + [b * s],
                      dtype=torch.int32, device=q.device)
    longest = max(e - c for cuts in docs.bounds for c, e in zip(cuts[:-1], cuts[1:]))
    flat = [t.transpose(1, 2).reshape(b * s, t.shape[1], t.shape[-1]) for t in (q, k, v)]  # (b*s, heads, d)
    o = varlen_attn(*flat, cu, cu, longest, longest, scale=scale, **args)
    return o.view(b, s, a, -1).transpose(1, 2)


# ---- blocks (ring attention): no autograd, explicit forward and backward ---------------------------

def block_forward(q, k, v, scale: float, causal: bool, pieces: list[Piece] | None = None):
    """One block: q (b, a, rq, d), k (b, g, rk, d), v (b, g, rk, dv) -> O (b, a, rq, dv) in q's dtype,
    L (b, a, rq) fp32. With `pieces` only those (document) sub-blocks attend; other rows get O = 0,
    L = -inf (nothing from this block)."""
    dv = v.shape[-1]
    q, k, v = _widen(q, k, v)
    if pieces is None:
        o, lse = _kernel_forward(q, k, v, scale, causal)
        return o[..., :dv], lse
    o = q.new_zeros(q.shape)
    lse = q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)
    for b, q0, q1, k0, k1, c in pieces:
        o_p, l_p = _kernel_forward(q[b:b + 1, :, q0:q1], k[b:b + 1, :, k0:k1], v[b:b + 1, :, k0:k1], scale, c)
        o[b:b + 1, :, q0:q1] = o_p
        lse[b:b + 1, :, q0:q1] = l_p
    return o[..., :dv], lse


def block_backward(do, q, k, v, out, lse, scale: float, causal: bool, pieces: list[Piece] | None = None):
    """Gradients of one block from the merged O (b, a, rq, dv) and L: -> dq (b, a, rq, d),
    dk (b, g, rk, d), dv (b, g, rk, dv), in q's dtype."""
    dv_w, d = v.shape[-1], q.shape[-1]
    do, q, k, v, out = _widen(do, q, k, v, out)
    if pieces is None:
        dq, dk, dv = _kernel_backward(do, q, k, v, out, lse, scale, causal)
        return dq[..., :d], dk[..., :d], dv[..., :dv_w]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for b, q0, q1, k0, k1, c in pieces:
        rq, rk = (slice(b, b + 1), slice(None), slice(q0, q1)), (slice(b, b + 1), slice(None), slice(k0, k1))
        g = _kernel_backward(do[rq], q[rq], k[rk], v[rk], out[rq], lse[rq], scale, c)
        dq[rq] += g[0]
        dk[rk] += g[1]
        dv[rk] += g[2]
    return dq[..., :d], dk[..., :d], dv[..., :dv_w]


def _kernel_forward(q, k, v, scale, causal):
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=None, scale=scale)
    return _per_group(_efficient_forward, q, k, v, scale, causal)


def _kernel_backward(do, q, k, v, out, lse, scale, causal):
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, causal, attn_mask=None, scale=scale)
    return _per_group_backward(do, q, k, v, out, lse, scale, causal)


def _efficient_forward(q, k, v, scale, causal):
    """CUDA memory-efficient kernel (equal head counts); its L is padded to a multiple of 32 rows."""
    o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
    return o, lse[..., :q.shape[2]].float()


def _efficient_backward(do, q, k, v, out, lse, scale, causal):
    """The kernel reads its tensors in the (b, s, heads, d) memory order its forward writes: given (b, heads,
    s, d)-contiguous ones, its bf16 backward returned wrong dq, dk (NaN, 1e35) with 8 heads, right with 2
    (an H100, torch 2.11; fp32 was right; the same test cases had failed on an H200). Each is passed in
    that order (a copy where it is not)."""
    do, q, k, v, out = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (do, q, k, v, out))
    pad = -lse.shape[-1] % 32
    lse = F.pad(lse, (0, pad)) if pad else lse
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        do, q, k, v, None, out, lse.contiguous(), zero, zero, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


def _group_view(t: torch.Tensor, g: int) -> torch.Tensor:
    """(b, a, s[, d]) -> (b, g, a/g, s[, d]): [:, :, j] are the j-th query heads of every KV head."""
    b, a = t.shape[:2]
    return t.view(b, g, a // g, *t.shape[2:])


def _per_group(kernel, q, k, v, scale, causal):
    """Run a kernel that wants as many KV heads as query heads once per query head of each group,
    reading K/V as they are (no per-head copies)."""
    g = k.shape[1]
    if q.shape[1] == g:
        return kernel(q, k, v, scale, causal)
    parts = [kernel(_group_view(q, g)[:, :, j], k, v, scale, causal) for j in range(q.shape[1] // g)]
    o = torch.stack([p[0] for p in parts], 2).flatten(1, 2)  # (b, a, rq, d)
    return o, torch.stack([p[1] for p in parts], 2).flatten(1, 2)


def _per_group_backward(do, q, k, v, out, lse, scale, causal):
    """The backward with K/V repeated to one head per query head (one kernel call), their gradients
    summed over each group in fp32."""
    r = q.shape[1] // k.shape[1]
    if r == 1:
        return _efficient_backward(do, q, k, v, out, lse, scale, causal)
    dq, dk, dv = _efficient_backward(do, q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1), out, lse, scale,
                                     causal)
    return dq, *(_group_view(t, k.shape[1]).sum(2, dtype=torch.float32).to(t.dtype) for t in (dk, dv))
