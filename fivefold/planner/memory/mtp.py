"""Multi-token prediction (model.mtp_num_layers = D; fivefold.model.mtp) beyond its decoder layers.

Each depth's decoder layer (the kind of the model's last layer) is one more layer of the last pipeline
rank in `Plan.layer_groups`, so its parameters, activations, compute and communication are counted
with the others. Besides it, per depth (Megatron-Core's count in its FLOPs formula):
    parameters   eh_proj 2h x h (split by TP), enorm, hnorm, final_norm (h each, replicated);
                 and, under PP, the last rank's copy of the input embedding (the head's, when tied)
    forward      eh_proj 2 * 2h * h and another output layer 2 * V * h FLOPs per token
    activations  per token: the embedding of the rolled ids, the two norms' inputs, eh_proj's input
                 (2h), the final norm's input: 6h values (/TP under SP), and another microbatch of
                 logits with the loss's saved softmax.
"""
from __future__ import annotations

from fivefold.config.schema import ModelConfig
from fivefold.planner.memory.params import layer_params


def mtp_params(m: ModelConfig, tp: int, embedding_elsewhere: bool, embedding: float) -> float:
    """Parameters one rank of the last pipeline rank holds for MTP beyond its layers; `embedding` is
    that rank's share of the input embedding, which it holds a copy of when the embedding is on
    another pipeline rank (`embedding_elsewhere`)."""
    depths = m.mtp_num_layers or 0
    if not depths:
        return 0.0
    h = m.hidden_size
    copy = embedding if embedding_elsewhere and not m.tie_word_embeddings else 0.0  # tied: the head is the copy
    return depths * (2 * h * h / tp + 3 * h) + copy


def mtp_forward_flops(m: ModelConfig) -> float:
    """Forward FLOPs per token of MTP beyond its layers: eh_proj and the extra output layers."""
    depths = m.mtp_num_layers or 0
    return depths * (2 * 2 * m.hidden_size * m.hidden_size + 2 * m.vocab_size * m.hidden_size)


def mtp_activation_values(m: ModelConfig) -> int:
    """Values per token per depth MTP saves for backward beyond its layer and logits (see above)."""
    return (m.mtp_num_layers or 0) * 6 * m.hidden_size


def mtp_stage_layers(m: ModelConfig) -> int:
    """MTP's work on the last pipeline stage in units of one of its decoder layers (matmul FLOPs: each
    depth's layer, eh_proj and output layer), for balancing the first/last-stage layer counts
    (`space.layer_splits`), as Megatron's DeepSeek-V3 layouts give MTP and the loss a stage of their
    own. 0 without MTP."""
    depths = m.mtp_num_layers or 0
    if not depths:
        return 0
    layer = 2 * layer_params(m, m.num_layers).active  # forward FLOPs per token of one MTP depth's layer
    return round(depths + mtp_forward_flops(m) / layer)
