"""Tensor-parallel building blocks against their one-process definitions: head split rules,
vocab-parallel cross-entropy, column/row linears in both modes, the vocab-parallel embedding, and
the gradient completion of replicated parameters."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _tol import close
from fivefold.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from fivefold.parallel.tensor.heads import split_heads
from fivefold.parallel.param_meta import named_metas
from fivefold.parallel.tensor.layers import (ColumnParallelLinear, RowParallelLinear, TPMode, VocabParallelEmbedding,
                                      mark_kv_replica, reduce_tp_grads)
from fivefold.runtime.mesh import Group, Mesh
from fivefold.topology import Layout


def shard(full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s even slice of `full` along `dim` split `size` ways (the reference cut)."""
    assert full.shape[dim] % size == 0, (full.shape, dim, size)
    return full.chunk(size, dim)[rank].clone()


def test_heads_split_when_kv_heads_reach_tp():
    s = [split_heads(8, 4, 2, r) for r in range(2)]
    assert [(x.q_heads, x.kv_heads, x.kv_replicas) for x in s] == [(range(0, 4), range(0, 2), 1),
                                                                     (range(4, 8), range(2, 4), 1)]


def test_kv_heads_replicated_when_tp_exceeds_them():
    for heads, kv, tp in [(8, 2, 4), (8, 1, 8), (4, 2, 4), (16, 4, 8)]:
        for r in range(tp):
            s = split_heads(heads, kv, tp, r)
            assert s.kv_replicas == tp // kv and len(s.kv_heads) == 1
            # every query head of this rank reads (HF's repeat_kv grouping) the KV head it holds
            assert {q // (heads // kv) for q in s.q_heads} == {s.kv_heads.start}


def test_head_split_refuses_uneven():
    with pytest.raises(ValueError, match="divisible"):
        split_heads(12, 6, 4, 0)
    with pytest.raises(ValueError, match="divide evenly"):
        split_heads(6, 6, 4, 0)


def _one():
    return Group("tp", (0,), None)


def test_cross_entropy_one_rank_matches_torch_with_padding_and_ignore():
    torch.manual_seed(0)
    vocab, padded = 100, 128
    logits = torch.randn(3, 7, padded, dtype=torch.float64)
    logits[..., vocab:] = 50.0  # padded columns must not count, however large
    labels = torch.randint(0, vocab, (3, 7))
    labels[0, :3] = -100
    x = logits.clone().requires_grad_(True)
    loss, logp = vocab_parallel_cross_entropy(x, labels, _one(), vocab)
    (loss.sum() + 0.5 * logp.square().sum()).backward()
    y = logits[..., :vocab].clone().requires_grad_(True)
    ref = F.cross_entropy(y.flatten(0, 1), labels.flatten(), reduction="none").view(3, 7)
    ref_logp = torch.where(labels == -100, 0.0, -ref)
    (ref.sum() + 0.5 * ref_logp.square().sum()).backward()
    # float64 throughout: the two compute the same log-sum-exp in another order: measured worst
    # 9.9e-16 absolute (a few fp64 ulps) over the CPU kernel settings; bound 1e-14, 10x.
    close(loss, ref, rtol=1e-14, atol=1e-14, site="tp_layers.ce_fp64_loss")
    close(logp, ref_logp, rtol=1e-14, atol=1e-14, site="tp_layers.ce_fp64_logp")
    close(x.grad[..., :vocab], y.grad, rtol=1e-14, atol=1e-14, site="tp_layers.ce_fp64_grad")
    assert torch.equal(x.grad[..., vocab:], torch.zeros(3, 7, padded - vocab, dtype=torch.float64))


def _ce_case(rank, world, vocab, padded):
    from fivefold.runtime import traffic

    mesh = Mesh.build(Layout(tp=world))
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, padded, generator=g)
    labels = torch.randint(0, vocab, (2, 5), generator=g)
    labels[1, 0] = -100
    mine = shard(logits, 2, mesh.tp.rank, world).requires_grad_(True)
    traffic.reset()
    loss, logp = vocab_parallel_cross_entropy(mine, labels, mesh.tp, vocab)
    (loss * torch.arange(10.0).view(2, 5)).sum().backward()
    return loss.detach(), mine.grad, traffic.bytes(tag="tp-loss"), traffic.calls(tag="tp-loss")


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_cross_entropy_matches_full(workers, world):
    vocab, padded = 300, 512  # on TP=4 the last rank holds padding only
    out = workers(world).run(_ce_case, vocab, padded)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, padded, generator=g)
    labels = torch.randint(0, vocab, (2, 5), generator=g)
    labels[1, 0] = -100
    full = logits[..., :vocab].clone().requires_grad_(True)
    ref = F.cross_entropy(full.flatten(0, 1), labels.flatten(), reduction="none").view(2, 5)
    (ref * torch.arange(10.0).view(2, 5)).sum().backward()
    grad = torch.cat([o[1] for o in out], -1)
    for rank, (loss, _, nbytes, calls) in enumerate(out):
        # fp32: the max and sum-exp are reduced across ranks in another order than torch's fused
        # log-softmax; a few ulps of log(sum exp): measured worst 4.8e-7 absolute on ~6 (0.0094 of
        # 1e-6 + 1e-5 * |want|); bound 1e-7 + 1e-6 * |want|, 10x.
        close(loss, ref.detach(), rtol=1e-6, atol=1e-7, site="tp_layers.vocab_ce_loss", case=f"tp{world} rank {rank}")
        assert (calls, nbytes) == (2, 10 * 4 + 2 * 10 * 4)  # max of 10 tokens; [sum-exp, z_y] of 10
    # measured worst 6.0e-8 absolute (0.043 of the bound, 23x)
    close(grad[..., :vocab], full.grad, rtol=1e-5, atol=1e-7, site="tp_layers.vocab_ce_grad", case=f"tp{world}")
    assert not grad[..., vocab:].any()


def _linears_case(rank, world, mode_name):
    mode = TPMode[mode_name]
    mesh = Mesh.build(Layout(tp=world))
    tp = mesh.tp
    g = torch.Generator().manual_seed(3)
    emb_w, w1, w2 = torch.randn(128 * world, 16, generator=g), torch.randn(48, 16, generator=g), torch.randn(16, 48, generator=g)
    ids = torch.randint(0, 100, (2, 8), generator=g)
    emb = VocabParallelEmbedding(128 * world, 16, group=tp, mode=mode)
    col = ColumnParallelLinear(16, 48, group=tp, mode=mode)
    row = RowParallelLinear(48, 16, group=tp, mode=mode)
    with torch.no_grad():
        for m, full in ((emb, emb_w), (col, w1), (row, w2)):
            m.weight.copy_(named_metas(m)["weight"].shard.of(full))
    x = emb(ids)  # (b, s, h) or (b, s/tp, h)
    y = row(torch.tanh(col(x))) + x
    weights = torch.arange(2 * 8 * 16.0).view(2, 8, 16) / 256  # dL/dy, the same on both sides
    if mode is TPMode.SEQUENCE_PARALLEL:
        weights = weights.chunk(world, 1)[tp.rank]
    (y * weights).sum().backward()
    return y.detach(), emb.weight.grad, col.weight.grad, row.weight.grad


@pytest.mark.parametrize("mode", ["ALL_REDUCE", "SEQUENCE_PARALLEL"])
def test_linears_match_one_process(workers, mode):
    world = 2
    out = workers(world).run(_linears_case, mode)
    g = torch.Generator().manual_seed(3)
    emb_w, w1, w2 = (t.requires_grad_(True) for t in (torch.randn(128 * world, 16, generator=g),
                                                       torch.randn(48, 16, generator=g), torch.randn(16, 48, generator=g)))
    ids = torch.randint(0, 100, (2, 8), generator=g)
    x = F.embedding(ids, emb_w)
    y = F.linear(torch.tanh(F.linear(x, w1)), w2) + x
    (y * torch.arange(2 * 8 * 16.0).view(2, 8, 16) / 256).sum().backward()
    sp = mode == "SEQUENCE_PARALLEL"
    # Row-parallel sums 2 partial products in another order than one matmul: fp32 rounding. Measured
    # worst 0.086 of the bound (3.8e-6 absolute on the output, 12x); the weight gradients of the
    # column and row shards came out equal under every CPU setting, which a matmul does not promise.
    tol = dict(rtol=1e-5, atol=1e-5)
    for r, (yr, ge, g1, g2) in enumerate(out):
        close(yr, y.detach().chunk(world, 1)[r] if sp else y.detach(), **tol, site="tp_layers.linears_out", case=f"{mode} rank {r}")
        close(ge, shard(emb_w.grad, 0, r, world), **tol, site="tp_layers.embedding_grad", case=f"{mode} rank {r}")
        close(g1, shard(w1.grad, 0, r, world), **tol, site="tp_layers.column_grad", case=f"{mode} rank {r}")
        close(g2, shard(w2.grad, 1, r, world), **tol, site="tp_layers.row_grad", case=f"{mode} rank {r}")


def _kv_case(rank, world):
    mesh = Mesh.build(Layout(tp=world))
    split = split_heads(8, 2, world, mesh.tp.rank)
    kv = torch.nn.Module()
    kv.weight = torch.nn.Parameter(torch.zeros(3))
    mark_kv_replica(kv, split, 2)
    kv.weight.grad = torch.full((3,), float(rank + 1))
    reduce_tp_grads([(kv.weight, named_metas(kv)["weight"])], mesh.tp)
    return kv.weight.grad


def test_kv_replica_grads_summed_over_their_replicas_only(workers):
    out = workers(4).run(_kv_case)
    # TP=4, 2 KV heads: ranks {0, 1} hold head 0, ranks {2, 3} head 1.
    assert [float(g[0]) for g in out] == [3.0, 3.0, 7.0, 7.0]
