"""Multi-head latent attention (MLA, DeepSeek-V2 / V3; Megatron-Core's `--multi-latent-attention`).

a heads; per head dn = qk_head_dim (no position), dr = qk_pos_emb_head_dim (decoupled RoPE),
dv = v_head_dim; r = kv_lora_rank, r_q = q_lora_rank. Names follow HF DeepseekV3Attention.
    queries:  q = x W_q                        (h -> a (dn+dr))            q_lora_rank None
              q = W_qb RMSNorm(x W_qa)         (h -> r_q -> a (dn+dr))     otherwise
    keys/values: [c, k_pe] = x W_kva           (h -> r + dr): a latent c and ONE rope key for all heads
              [k_nope, v] = W_kvb RMSNorm(c)   (r -> a (dn+dv))
    q = [q_nope, rope(q_pe)], k = [k_nope, rope(k_pe)] per head (dn+dr wide), v dv wide
    o = softmax(q k^T / sqrt(dn+dr) + causal) v,   y = o W_o   (a dv -> h)
The two latent RMSNorms exist with `qk_layernorm` (Megatron-Core builds them into the up-projections'
LayerNormLinear only with --qk-layernorm; without it the latents go to W_qb / W_kvb unnormalised). HF's
DeepseekV3 always has them (q_a_layernorm, kv_a_layernorm): its import sets qk_layernorm.
RoPE runs on the dr-wide parts in DeepSeek's layout: the weights put each rotated pair side by side,
(x0, x1), (x2, x3), ... (HF `rope_interleave=True`, Megatron's MLA rotary path), so the pairs are
first gathered into halves [x0, x2, ...; x1, x3, ...] and then rotated with rotate_half (rope.py);
HF's apply_rotary_pos_emb_interleave returns exactly that layout.

Tensor parallelism (Megatron-Core): the up-projections W_q / W_qb and W_kvb are column-parallel by
heads, W_o row-parallel; the down-projections W_qa, W_kva and the latent norms are replicated on
every TP rank. The latents enter the column layers through those layers' own collective
(ALL_REDUCE: f, identity forward / all-reduce of the gradient backward; SEQUENCE_PARALLEL: all-gather
along the sequence / reduce-scatter backward), and k_pe, read by every head, through the same
collective. So the down-projections run on what the block receives: the whole sequence without SP
(their gradients are then already complete on every rank), this rank's s/tp tokens under SP (each
rank's weight gradient covers its tokens only: the gradients are summed over TP like the SP norm
gains', `mark_sequence_sharded`). Gathering the latents (r_q + r + dr wide) instead of x (h wide)
is also what keeps MLA's SP traffic small when queries are compressed (DeepSeek-V3: 1536 + 512 + 64
features per token instead of h = 7168); with uncompressed queries x itself is gathered for q_proj
and the kv latent besides (h + r + dr).
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from fivefold.config.schema import ModelConfig
from fivefold.errors import UserError
from fivefold.model.attention import core_attention
from fivefold.model.norm import RMSNorm
from fivefold.model.recompute import maybe_checkpoint
from fivefold.model.rope import apply_rope
from fivefold.ops.attention import Documents
from fivefold.parallel.context.context_parallel import ContextParallel
from fivefold.parallel.tensor.layers import (SEQ_DIM, ColumnParallelLinear, RowParallelLinear, TPMode,
                                      mark_sequence_sharded)
from fivefold.runtime import comm


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(..., d) with rotated pairs side by side -> the pairs' first and second elements as halves."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _column(h_in: int, heads: int, per_head: int, tp, mode: TPMode) -> nn.Module:
    """A projection to `heads` x `per_head` features: this rank's heads' rows when `tp` is given."""
    if tp is None:
        return nn.Linear(h_in, heads * per_head, bias=False)
    n = heads // tp.size
    rows = range(tp.rank * n * per_head, (tp.rank + 1) * n * per_head)
    return ColumnParallelLinear(h_in, heads * per_head, group=tp, mode=mode, rows=rows)


class MLAttention(nn.Module):
    """See the module docstring; x is (b, s, h), or (b, s/tp, h) under sequence parallelism."""

    def __init__(self, cfg: ModelConfig, tp=None, mode: TPMode = TPMode.ALL_REDUCE):
        super().__init__()
        h, a = cfg.hidden_size, cfg.num_attention_heads
        self.dn, self.dr, self.dv, self.r = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        dn, dr, dv, r, r_q = self.dn, self.dr, self.dv, self.r, cfg.q_lora_rank
        if dr % 2:
            raise UserError(f"qk_pos_emb_head_dim={dr} must be even (RoPE rotates pairs; DeepSeek uses 64)")
        if tp is not None and a % tp.size:
            raise UserError(f"num_attention_heads={a} must divide evenly over tensor_model_parallel_size={tp.size} "
                            "(MLA splits its heads over TP)")
        self.tp, self.mode, self.q_lora_rank = tp, mode, r_q
        self.recompute_core = False
        """Selective recompute: keep q, k, v and recompute the core attention in backward."""
        self.context_parallel: ContextParallel | None = None
        """Context parallelism (set by the Decoder): attention over the sequence split across CP."""
        if r_q is None:
            self.q_proj = _column(h, a, dn + dr, tp, mode)
        else:
            self.q_a_proj = nn.Linear(h, r_q, bias=False)
            self.q_a_layernorm = RMSNorm(r_q, cfg.norm_epsilon) if cfg.qk_layernorm else nn.Identity()
            self.q_b_proj = _column(r_q, a, dn + dr, tp, mode)
        self.kv_a_proj_with_mqa = nn.Linear(h, r + dr, bias=False)
        self.kv_a_layernorm = RMSNorm(r, cfg.norm_epsilon) if cfg.qk_layernorm else nn.Identity()
        self.kv_b_proj = _column(r, a, dn + dv, tp, mode)
        self.o_proj = nn.Linear(a * dv, h, bias=False) if tp is None else RowParallelLinear(a * dv, h, group=tp, mode=mode)
        if tp is not None and mode is TPMode.SEQUENCE_PARALLEL:
            mark_sequence_sharded(self, replicated_only=True)  # replicated, fed this rank's s/tp tokens

    def _shared_key(self, k_pe: torch.Tensor) -> torch.Tensor:
        """k_pe, read by the heads of every TP rank, through the collective the column layers use."""
        if self.tp is None:
            return k_pe
        if self.mode is TPMode.SEQUENCE_PARALLEL:
            return comm.gather(k_pe, SEQ_DIM, self.tp, "sp")  # (b, s/tp, dr) -> (b, s, dr)
        return comm.copy_to(k_pe, self.tp, "tp")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: Documents | None = None,
                noise=None) -> torch.Tensor:
        """x (b, s, h) [or (b, s/tp, h)]; cos/sin (s, dr) or (b, s, dr) -> (b, s, h) [or (b, s/tp, h)];
        `docs`: document boundaries of the batch (each document attends to itself). `noise` is not
        read: attention dropout with MLA is refused (train.supported); hidden dropout is the layer's."""
        dn, dr, dv = self.dn, self.dr, self.dv
        if self.q_lora_rank is None:
            q = self.q_proj(x)  # (b, s, a/tp*(dn+dr))
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # (b, s(/tp), r_q) -> (b, s, a/tp*(dn+dr))
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.r, dr], dim=-1)  # (b, s(/tp), r), (b, s(/tp), dr)
        kv = self.kv_b_proj(self.kv_a_layernorm(c))  # (b, s, a/tp*(dn+dv))
        k_pe = self._shared_key(k_pe)  # (b, s, dr)
        b, s = q.shape[:2]
        q_nope, q_pe = q.view(b, s, -1, dn + dr).transpose(1, 2).split([dn, dr], dim=-1)  # (b, a/tp, s, dn|dr)
        k_nope, v = kv.view(b, s, -1, dn + dv).transpose(1, 2).split([dn, dv], dim=-1)  # (b, a/tp, s, dn|dv)
        q_pe = apply_rope(deinterleave(q_pe), cos, sin)
        k_pe = apply_rope(deinterleave(k_pe).unsqueeze(1), cos, sin)  # (b, 1, s, dr): one key for all heads
        q = torch.cat((q_nope, q_pe), dim=-1)  # (b, a/tp, s, dn+dr)
        k = torch.cat((k_nope, k_pe.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)  # (b, a/tp, s, dn+dr)
        o = maybe_checkpoint(partial(core_attention, cp=self.context_parallel, docs=docs), self.recompute_core,
                             q, k, v)  # (b, a/tp, s, dv); s is this rank's s/cp under CP
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))  # (b, s, a/tp*dv) -> (b, s, h) or (b, s/tp, h)
