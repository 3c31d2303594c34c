"""Parameter counts of a `ModelConfig`, by layer and by kind (dense vs routed-expert).

The decoder is a pre-norm Transformer with SwiGLU MLPs, RMSNorm and no linear biases:
  embedding V*h, output layer V*h (unless tied), final norm h;
  per layer: 2 norms (2h);
    attention, GQA:  q and o: 2*h*a*d,  k and v: 2*h*g*d          (a heads, g KV groups, d = head_dim)
    attention, MLA:  q: h*(a*(dn+dr))                 without q compression, or
                        h*r_q + r_q + r_q*a*(dn+dr)   with it (down, norm, up)
                     kv: h*(r_kv+dr) + r_kv + r_kv*a*(dn+dv);  o: a*dv*h
    dense MLP:       3*h*f                             (gate, up, down)
    MoE MLP:         router h*E + E*3*h*f_e + 3*h*f_s   (E routed experts of width f_e, shared width f_s)
Active per token: the same with E replaced by top-k in the routed-expert term.
"""
from __future__ import annotations

from dataclasses import dataclass

from fivefold.config.schema import ModelConfig


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one decoder layer, split by how they are sharded."""

    attention: int
    """Attention projections split by TP (MLA: the up-projections and o)."""
    norms: int
    """RMSNorm weights and the router (replicated over TP)."""
    dense_mlp: int
    """Dense MLP or shared experts (split by TP)."""
    experts: int
    """All routed experts (split by ETP x EP); 0 in a dense layer."""
    active_experts: int
    """Routed-expert parameters one token passes through (top-k of them)."""
    latent: int = 0
    """MLA's down-projections and latent norms, replicated over TP (fivefold/model/mla.py)."""

    @property
    def total(self) -> int:
        return self.attention + self.latent + self.norms + self.dense_mlp + self.experts

    @property
    def active(self) -> int:
        return self.attention + self.latent + self.norms + self.dense_mlp + self.active_experts


def attention_params(m: ModelConfig) -> int:
    h, a = m.hidden_size, m.num_attention_heads
    if m.multi_latent_attention:
        dn, dr, dv, r_kv = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim, m.kv_lora_rank
        n = m.qk_layernorm  # the latent norms' gains
        q = h * a * (dn + dr) if not m.q_lora_rank else h * m.q_lora_rank + m.q_lora_rank * n + m.q_lora_rank * a * (dn + dr)
        kv = h * (r_kv + dr) + r_kv * n + r_kv * a * (dn + dv)
        return q + kv + a * dv * h
    d, g = m.head_dim, m.kv_heads
    biases = (a + 2 * g) * d if m.add_qkv_bias or m.add_bias_linear else 0  # QKV, + o_proj's below
    return 2 * h * a * d + 2 * h * g * d + biases + (h if m.add_bias_linear else 0)


def kv_params(m: ModelConfig) -> int:
    """The k and v projections of GQA attention (weights and QKV biases): the part of
    `attention_params` a TP rank holds whole per KV head when TP > KV heads (`kv_tp_split`)."""
    if m.multi_latent_attention:
        return 0
    d, g = m.head_dim, m.kv_heads
    return 2 * g * d * (m.hidden_size + (1 if m.add_qkv_bias or m.add_bias_linear else 0))


def kv_tp_split(m: ModelConfig, tp: int) -> int:
    """How many ways TP splits the k and v projections: by TP, or by the KV heads when TP exceeds
    them (each rank then holds one whole KV head, replicated over TP / g ranks: fivefold.parallel.tensor.heads)."""
    return min(tp, m.kv_heads) if not m.multi_latent_attention else tp


def latent_params(m: ModelConfig) -> int:
    """MLA's replicated part of `attention_params`: W_qa and its norm (with query compression), W_kva
    and the KV latent's norm. 0 for GQA."""
    if not m.multi_latent_attention:
        return 0
    h, r_kv, r_q = m.hidden_size, m.kv_lora_rank, m.q_lora_rank
    norms = m.qk_layernorm  # the latent norms (Megatron's --qk-layernorm with MLA)
    return h * (r_kv + m.qk_pos_emb_head_dim) + r_kv * norms + (h * r_q + r_q * norms if r_q else 0)


def is_moe_layer(m: ModelConfig, index: int) -> bool:
    """Whether decoder layer `index` (0-based) has routed experts."""
    return m.is_moe and index >= m.moe_first_k_dense_layers


_CACHE: dict[int, tuple[ModelConfig, dict]] = {}


def layer_params(m: ModelConfig, index: int) -> LayerParams:
    """Parameters of decoder layer `index` (cached per model object and layer kind)."""
    entry = _CACHE.get(id(m))
    if entry is None or entry[0] is not m:
        entry = _CACHE[id(m)] = (m, {})
    moe = is_moe_layer(m, index)
    if moe not in entry[1]:
        entry[1][moe] = _layer_params(m, index)
    return entry[1][moe]


def _layer_params(m: ModelConfig, index: int) -> LayerParams:
    h = m.hidden_size
    latent = latent_params(m)
    attn = attention_params(m) - latent
    norms = 2 * norm_params(m)
    if m.qk_layernorm and not m.multi_latent_attention:  # + GQA's q / k norms (gain, and LayerNorm's bias)
        width = 2 * m.head_dim if m.qk_layernorm_scope == "head" else (m.num_attention_heads + m.kv_heads) * m.head_dim
        norms += norm_params(m) // h * width  # over d each, or over the q (a*d) and k (g*d) projections
    if not is_moe_layer(m, index):
        f, k = m.ffn_size, m.mlp_matrices
        mlp_biases = (k - 1) * f + h if m.add_bias_linear else 0  # column biases (f each) + the row bias (h)
        return LayerParams(attention=attn, norms=norms, dense_mlp=k * h * f + mlp_biases, experts=0, active_experts=0,
                           latent=latent)
    f_e = m.moe_ffn_hidden_size or m.ffn_size
    shared = 3 * h * (m.moe_shared_expert_intermediate_size or 0)
    per_expert = 3 * h * f_e
    return LayerParams(attention=attn, norms=norms + h * m.num_experts, dense_mlp=shared,
                       experts=m.num_experts * per_expert, active_experts=m.moe_router_topk * per_expert, latent=latent)


def embedding_params(m: ModelConfig, tp: int | None = None) -> int:
    """Input embedding: V*h (V padded for `tp` when given, else the tokenizer's V)."""
    v = m.vocab_size if tp is None else m.padded_vocab_size(tp)
    return v * m.hidden_size


def position_params(m: ModelConfig) -> int:
    """The learned absolute position table (max_position_embeddings x h, replicated), or 0."""
    return m.max_position_embeddings * m.hidden_size if m.position_embedding_type == "learned_absolute" else 0


def norm_params(m: ModelConfig) -> int:
    """One norm of width h: its gain, and LayerNorm's bias."""
    return m.hidden_size * (2 if m.normalization == "LayerNorm" else 1)


def output_params(m: ModelConfig, tp: int | None = None) -> int:
    """Final norm + output layer (0 for the output layer when tied to the embedding)."""
    return norm_params(m) + (0 if m.tie_word_embeddings else embedding_params(m, tp))


@dataclass(frozen=True)
class ParamCount:
    total: int
    active: int
    embedding: int
    """Input embedding + output layer (counted in total and active)."""
    experts: int
    """Routed-expert parameters over all layers."""


def count_params(m: ModelConfig) -> ParamCount:
    """Total and per-token-active parameters (unpadded vocabulary, as authors publish them)."""
    layers = [layer_params(m, i) for i in range(m.num_layers)]
    emb = embedding_params(m) + output_params(m) - norm_params(m) + position_params(m)
    ends = embedding_params(m) + output_params(m) + position_params(m)
    return ParamCount(total=ends + sum(x.total for x in layers), active=ends + sum(x.active for x in layers),
                      embedding=emb, experts=sum(x.experts for x in layers))
