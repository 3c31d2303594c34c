"""fivefold.model.dropout in one process: the explicit attention path equals the fused kernels,
masks keep 1 - p of the elements, and a mask drawn for any part of the coordinates is that part of
the whole one (what makes every layout equal one process: tests/test_megatron_defaults_layouts.py)."""
from __future__ import annotations

import torch

from _tol import close
from fivefold.model.dropout import DropoutKey, Noise, explicit_attention, keep_mask
from fivefold.ops.attention import Documents, attention
from fivefold.parallel.context.context_parallel import local_positions


def test_explicit_attention_without_dropout_equals_the_kernels():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 16, 8, generator=g) for h in (4, 2, 2))
    docs = Documents(((0, 5, 16), (0, 16)))
    pos = torch.arange(16)
    for d in (None, docs):
        got = explicit_attention(q, k, v, scale=8 ** -0.5, docs=d, drop=lambda p: p, q_pos=pos, k_pos=pos)
        # fp32, the same softmax by two summation orders: measured 3e-7 abs, bound 1e-5
        close(got, attention(q, k, v, docs=d), rtol=0, atol=1e-5, site="dropout.explicit_attention",
              case=str(d is not None))


def test_masks_keep_one_minus_p_and_parts_are_parts_of_the_whole():
    keep = keep_mask((1, 2, 3, 4), [torch.arange(4).view(-1, 1, 1), torch.arange(64).view(1, -1, 1),
                                    torch.arange(256).view(1, 1, -1)], 0.1)
    assert abs(keep.float().mean().item() - 0.9) < 0.005  # 65536 draws: 5 sigma ~ 0.006
    key = DropoutKey(step=7, samples=torch.tensor([11, 3]))
    whole = Noise(5, key, 0.1, 0.1, torch.arange(32), torch.arange(32)).hidden(torch.ones(2, 32, 8), 1, 2)
    for r in range(2):  # CP=2: rank r holds chunks r and 3 - r
        pos = local_positions(16, 2, r)
        part = Noise(5, key, 0.1, 0.1, pos, pos).hidden(torch.ones(2, 16, 8), 1, 2)
        assert torch.equal(part, whole[:, pos])
    other = Noise(5, DropoutKey(8, key.samples), 0.1, 0.1, torch.arange(32), torch.arange(32))
    assert not torch.equal(other.hidden(torch.ones(2, 32, 8), 1, 2), whole)  # a new step, new masks
