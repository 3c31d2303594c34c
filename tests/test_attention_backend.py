"""fivefold.ops.attention on each device this machine has (CUDA cases skip without a GPU): the ring's
building blocks — block forward, log-sum-exp merge, block backward from the merged O and L — against
one scaled_dot_product_attention call, with GQA unexpanded and MLA's dv != d; and, on CUDA, the
documents path (varlen) against per-document calls."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _tol import close
from fivefold.ops.attention import Documents, attention, block_backward, block_forward
from fivefold.parallel.context.ring_attention import merge_

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
CASES = [pytest.param("cpu", torch.float32, id="cpu-fp32"),
         pytest.param("cuda", torch.float32, id="cuda-fp32", marks=CUDA),
         pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=CUDA)]
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
"""fp32: measured worst 1.2e-6 on CPU (O(1) values; 0.05 of the bound), 0.049 of it on an H100. bf16: 8 mantissa
bits, a value's rounding alone is 2^-9 relative; partial softmaxes merged in fp32 from bf16 blocks: bound
3e-2. On CPU in bf16 the same comparisons use 0.06-0.21 of it; on an H100 (torch 2.11) the
worst case uses 0.23 (block gradients, dv=32), 4x margin. These cases caught the CUDA kernel's bf16
backward reading (b, heads, s, d)-ordered tensors wrongly (ops.attention._efficient_backward)."""


def _qkv(device, dtype, a=8, g=2, s=64, d=32, dv=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, s, w, generator=gen) for h, w in ((a, d), (g, d), (g, dv)))
    return [t.to(device, dtype) for t in (q, k, v)]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("dv", [32, 24])
def test_blocks_merged_by_lse_equal_one_call(device, dtype, dv):
    """The last 16 query rows against all 64 keys in four key blocks (three full, the diagonal one
    causal), merged as the ring merges them, then the backward of each block from the merged O and L."""
    q, k, v = _qkv(device, dtype, dv=dv)
    scale = q.shape[-1] ** -0.5
    rows = slice(48, 64)
    ref_q, ref_k, ref_v = (t.detach().float().clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(ref_q, ref_k, ref_v, is_causal=True, enable_gqa=True)
    do = torch.randn_like(ref)
    ref.backward(do)
    out = lse = None
    blocks = [(slice(0, 16), False), (slice(16, 32), False), (slice(32, 48), False), (slice(48, 64), True)]
    for cols, causal in blocks:
        o_i, l_i = block_forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], scale, causal)
        assert o_i.dtype == dtype and l_i.dtype == torch.float32
        if out is None:
            out, lse = o_i.float(), l_i.clone()
        else:
            merge_(out, lse, o_i, l_i)
    tol = TOL[dtype]
    close(out, ref[:, :, rows], rtol=tol, atol=tol, site="backend.merge", case=f"{device} {dtype} dv={dv}")
    dq = torch.zeros_like(q[:, :, rows], dtype=torch.float32)
    dk, dv_ = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    d_out = do[:, :, rows].to(dtype)
    for cols, causal in blocks:
        g = block_backward(d_out, q[:, :, rows], k[:, :, cols], v[:, :, cols], out.to(dtype), lse, scale, causal)
        dq += g[0]
        dk[:, :, cols] += g[1]
        dv_[:, :, cols] += g[2]
    # the reference's key/value grads include the first 48 rows' contributions: take them out
    part_q, part_k, part_v = (t.detach().float().clone().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(part_q, part_k, part_v, is_causal=True, enable_gqa=True)[:, :, :48].backward(
        do[:, :, :48])
    for got, want in ((dq, ref_q.grad[:, :, rows]), (dk, ref_k.grad - part_k.grad), (dv_, ref_v.grad - part_v.grad)):
        close(got, want, rtol=tol, atol=tol, site="backend.block_grads", case=f"{device} {dtype} dv={dv}")


@pytest.mark.parametrize("device,dtype", CASES)
def test_attention_with_documents_equals_per_document_calls(device, dtype):
    """On CUDA in bf16 this is torch.nn.attention.varlen; elsewhere per-document calls."""
    q, k, v = _qkv(device, dtype)
    docs = Documents(((0, 10, 40, 64), (0, 64)))
    o = attention(q, k, v, docs=docs)
    for b, cuts in enumerate(docs.bounds):
        for s0, s1 in zip(cuts[:-1], cuts[1:]):
            want = F.scaled_dot_product_attention(*(t[b:b + 1, :, s0:s1].float() for t in (q, k, v)), is_causal=True,
                                                  enable_gqa=True)
            close(o[b:b + 1, :, s0:s1], want, rtol=TOL[dtype], atol=TOL[dtype], site="backend.documents",
                  case=f"{device} {dtype} row {b} [{s0},{s1})")
