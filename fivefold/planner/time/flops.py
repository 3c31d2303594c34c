"""Model FLOPs, the numerator of MFU.

Forward FLOPs of one token through decoder layer l (a matmul of a (n x k) by (k x m) costs 2nkm):
    2 * (matmul parameters the token passes through: attention projections, the dense MLP or the
         shared experts + top-k routed experts, the router)
  + 2 * a * (d_qk + d_v) * s / 2     (causal attention: QK^T and AV over s/2 keys on average)
and through the output layer 2 * V * h. The embedding lookup and norms count 0. Multi-token
prediction adds its layers and, per depth, eh_proj and another output layer (planner/memory/mtp.py), as
Megatron-Core counts them.
Training = forward + backward = 3 x forward (backward is two matmuls per forward matmul), so per
step: model FLOPs = 3 * tokens * (sum_l F_l + 2 V h) -- the "6 N T" rule plus attention.
Recomputation is not model work: it is added to hardware FLOPs (`recompute_flops`), never to MFU.
A forward-only model (an RL reference's log-probs, planner/search/forward.py) does the forward alone, without
MTP's layers and heads, which `Engine.forward` does not run: `forward_flops_per_token`.
"""
from __future__ import annotations

from fivefold.config.schema import ModelConfig
from fivefold.planner.memory.mtp import mtp_forward_flops
from fivefold.planner.memory.params import layer_params


def attention_core_flops(m: ModelConfig, seq: int) -> float:
    """Forward FLOPs per token of QK^T and AV, causal."""
    a = m.num_attention_heads
    if m.multi_latent_attention:
        dqk, dv = m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim
    else:
        dqk = dv = m.head_dim
    return 2 * a * (dqk + dv) * seq / 2


def layer_forward_flops(m: ModelConfig, index: int, seq: int) -> float:
    """Forward FLOPs per token of decoder layer `index`."""
    lp = layer_params(m, index)
    router = m.hidden_size * m.num_experts if lp.experts else 0
    matmul = lp.attention + lp.latent + lp.dense_mlp + lp.active_experts + router
    return 2 * matmul + attention_core_flops(m, seq)


def output_forward_flops(m: ModelConfig) -> float:
    return 2 * m.vocab_size * m.hidden_size


def model_flops_per_token(m: ModelConfig, seq: int) -> float:
    """Training (forward + backward) model FLOPs per token."""
    key = (id(m), seq)
    got = _PER_TOKEN.get(key)
    if got is None or got[0] is not m:
        layers = m.num_layers + (m.mtp_num_layers or 0)  # MTP's layers are indices num_layers.. (planner/memory/mtp.py)
        fwd = sum(layer_forward_flops(m, i, seq) for i in range(layers)) + output_forward_flops(m) + mtp_forward_flops(m)
        got = _PER_TOKEN[key] = (m, 3 * fwd)
    return got[1]


def forward_flops_per_token(m: ModelConfig, seq: int) -> float:
    """Forward-only model FLOPs per token: the decoder layers and the output layer, once."""
    return sum(layer_forward_flops(m, i, seq) for i in range(m.num_layers)) + output_forward_flops(m)


_PER_TOKEN: dict[tuple[int, int], tuple[ModelConfig, float]] = {}
"""(id(model), seq) -> (the model, its FLOPs per token): the search asks once per layout."""
