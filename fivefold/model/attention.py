"""Grouped-query self-attention with RoPE, through scaled_dot_product_attention (causal).

a query heads share g key/value heads (a % g == 0); query head i reads KV head i // (a/g), the
same grouping as HF's repeat_kv. head_dim d is independent of h/a:
    q = x W_q (h -> a*d), k = x W_k (h -> g*d), v = x W_v (h -> g*d)
    o = softmax(rope(q) rope(k)^T / sqrt(d) + causal) v,   y = o W_o (a*d -> h)
Variants: `add_qkv_bias` (Qwen2, Megatron's --add-qkv-bias): q, k, v get biases (column-parallel:
sharded with their rows); `qk_layernorm` (Qwen3, Megatron's --qk-layernorm): q and k are normalised
per head over d (the model's norm type) before RoPE — under TP each rank normalises its own heads,
and the gains' gradients are summed over TP (each rank saw only its heads). With
qk_layernorm_scope "projection" (OLMoE) q is RMS-normalised over all its a*d features and k over its
g*d, before the split into heads; under TP the gains are sharded with q_proj's / k_proj's rows and the
sum of squares is all-reduced over TP (fivefold.model.norm.SplitRMSNorm).
`add_bias_linear` (Megatron's default): q, k, v and o all biased; o_proj's row-parallel bias is added
once, after the reduction. With learned absolute (or no) positions cos/sin are None: no rotation.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from fivefold.config.schema import ModelConfig
from fivefold.ops.attention import Documents, attention, cached_attention
from fivefold.model.dropout import Noise, explicit_attention
from fivefold.model.norm import SplitRMSNorm, make_norm
from fivefold.model.recompute import maybe_checkpoint
from fivefold.model.rope import apply_rope
from fivefold.parallel.context.context_parallel import ContextParallel
from fivefold.parallel.tensor.heads import HeadSplit, split_heads
from fivefold.parallel.tensor.layers import TPMode, column_linears, linear, mark_kv_replica, mark_sequence_sharded


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp: ContextParallel | None = None,
                   scale: float | None = None, docs: Documents | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + causal) v with GQA (scale default 1/sqrt(d)): q (b, a, s, d),
    k (b, g, s, d), v (b, g, s, dv) -> (b, a, s, dv), by fivefold.ops.attention. With `cp`
    (context parallelism) s is this rank's s/cp tokens (fivefold.parallel.context.context_parallel's split) and
    attention covers the whole sequence. `docs`: document boundaries of the whole (b, s) batch."""
    if cp is not None and cp.size > 1:
        return cp.attention(q, k, v, scale=scale, docs=docs)
    return attention(q, k, v, scale=scale, docs=docs)


def _qk_norms(cfg: ModelConfig, tp=None, split: HeadSplit | None = None) -> tuple[nn.Module, nn.Module]:
    """The q and k norms of `qk_layernorm`: per head, of width d (every rank holds them whole); or over
    the whole projection (RMSNorm: the decoder refuses other norms), of widths a*d and g*d (one process)
    or this rank's heads' rows of them (TP)."""
    a, g, d = cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim
    if cfg.qk_layernorm_scope == "head":
        return make_norm(cfg, d), make_norm(cfg, d)
    if split is None:
        return make_norm(cfg, a * d), make_norm(cfg, g * d)
    norm = partial(SplitRMSNorm, eps=cfg.norm_epsilon, zero_centered=cfg.apply_layernorm_1p, group=tp)
    return (norm(a * d, rows=range(split.q_heads.start * d, split.q_heads.stop * d)),
            norm(g * d, rows=range(split.kv_heads.start * d, split.kv_heads.stop * d), replicas=split.kv_replicas))


class Attention(nn.Module):
    """q/k/v_proj column-parallel (split by heads), o_proj row-parallel when `tp` has > 1 rank:
    this rank then holds the query heads and KV heads of `split_heads` (KV heads replicated when
    TP > KV heads) and computes attention for its heads only; x is (b, s/tp, h) under SP."""

    def __init__(self, cfg: ModelConfig, tp=None, mode: TPMode = TPMode.ALL_REDUCE):
        super().__init__()
        h, self.d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.kv_heads
        a, g, d = self.heads, self.kv_heads, self.d
        self.recompute_core = False
        """Selective recompute: keep q, k, v and recompute the core attention in backward."""
        self.context_parallel: ContextParallel | None = None
        """Context parallelism (set by the Decoder): attention over the sequence split across CP."""
        qkv_bias = cfg.add_bias_linear or cfg.add_qkv_bias  # Megatron: linear biases, or Qwen2's QKV-only
        split = split_heads(a, g, tp.size, tp.rank) if tp is not None else None
        self.norm_per_head = cfg.qk_layernorm_scope == "head"
        """q / k norms over each head's d features (Qwen3), else over the whole projection (OLMoE)."""
        self.q_norm, self.k_norm = _qk_norms(cfg, tp, split) if cfg.qk_layernorm else (None, None)
        self.layer = 0
        """Global layer index (set by DecoderLayer): a coordinate of the attention dropout masks."""
        self.head_range = range(a) if split is None else split.q_heads
        """Global indices of this rank's query heads (attention dropout masks)."""
        kv_rows = range(split.kv_heads.start * d, split.kv_heads.stop * d) if split else None
        column = partial(linear, tp=tp, split="column", mode=mode, bias=qkv_bias)
        self.q_proj = column(h, a * d)
        self.k_proj = column(h, g * d, rows=kv_rows)
        self.v_proj = column(h, g * d, rows=kv_rows)
        self.o_proj = linear(a * d, h, tp=tp, split="row", mode=mode, bias=cfg.add_bias_linear)
        if split is not None and split.kv_replicas > 1:
            for m in (self.k_proj, self.v_proj):
                mark_kv_replica(m, split, g)
        for norm in (self.q_norm, self.k_norm) if tp is not None and self.norm_per_head else ():
            if norm is not None:  # replicated gains, each rank's gradient from its heads only
                mark_sequence_sharded(norm)
        if split is not None and split.kv_replicas > 1 and not self.norm_per_head and self.k_norm is not None:
            mark_kv_replica(self.k_norm, split, g)  # the gains of a replicated KV head

    def _dropout_attention(self, q, k, v, *, noise: Noise, docs) -> torch.Tensor:
        """Attention with dropout on the probabilities, masks by global (sample, head, q, k); under CP
        the keys and values of the whole sequence are gathered first (each rank's queries see all)."""
        cp, k_pos = self.context_parallel, noise.positions
        if cp is not None and cp.size > 1:
            (k, k_pos), (v, _) = cp.whole_sequence(k), cp.whole_sequence(v)  # (b, g/tp, s, d)
        heads = torch.arange(self.head_range.start, self.head_range.stop)
        drop = partial(noise.probs, layer=self.layer, heads=heads, k_positions=k_pos)
        return explicit_attention(q, k, v, scale=self.d ** -0.5, docs=docs, drop=drop, q_pos=noise.positions,
                                  k_pos=k_pos)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: Documents | None = None,
                noise: Noise | None = None, cache: list | None = None) -> torch.Tensor:
        """`noise`: this forward's dropout (fivefold.model.dropout); attention dropout then runs the
        explicit softmax path, the probabilities masked by global (sample, head, q, k). `cache`
        (generation, fivefold.model.generate): [k, v] of the positions before x's, extended in place."""
        q, k, v = column_linears(x, [self.q_proj, self.k_proj, self.v_proj])  # (b, s, (a|g)/tp * d)
        if self.q_norm is not None and not self.norm_per_head:  # OLMoE: over all of q's (k's) features
            q, k = self.q_norm(q), self.k_norm(k)
        b, s = q.shape[:2]
        q = q.view(b, s, -1, self.d).transpose(1, 2)  # (b, a/tp, s, d)
        k = k.view(b, s, -1, self.d).transpose(1, 2)  # (b, g/tp, s, d)
        v = v.view(b, s, -1, self.d).transpose(1, 2)  # (b, g/tp, s, d)
        if self.q_norm is not None and self.norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None:  # RoPE; learned absolute positions were added to the embedding instead
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # decoding: this rank's heads' keys and values of every earlier position
            if cache:
                k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
            cache[:] = [k, v]
            core = cached_attention
        elif noise is not None and noise.attention_p > 0:
            core = partial(self._dropout_attention, noise=noise, docs=docs)
        else:
            core = partial(core_attention, cp=self.context_parallel, docs=docs)
        o = maybe_checkpoint(core, self.recompute_core, q, k, v)  # (b, a/tp, s, d)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))  # (b, s, a/tp*d) -> (b, s, h) or (b, s/tp, h)
