"""Our parameter names <-> Hugging Face's, per family (`hf_name`): the one map import and export share, so
import -> export gives the same tensors, bit for bit.

Name map (ours <- HF):
    embedding.weight               <- model.embed_tokens.weight
    layers.i.attn_norm.weight      <- model.layers.i.input_layernorm.weight
    layers.i.attn.{q,k,v,o}_proj   <- model.layers.i.self_attn.{q,k,v,o}_proj (Qwen2: q/k/v .bias too)
    layers.i.attn.{q,k}_norm       <- model.layers.i.self_attn.{q,k}_norm (Qwen3: per head, width head_dim;
                                      OLMoE: over the whole projection, widths a*head_dim and g*head_dim)
    layers.i.mlp_norm.weight       <- model.layers.i.post_attention_layernorm.weight
    layers.i.mlp.{gate,up,down}_proj <- model.layers.i.mlp.{gate,up,down}_proj
    final_norm.weight              <- model.norm.weight
    head.weight                    <- lm_head.weight (model.embed_tokens.weight when tied)
Mixtral's MoE layers, as its checkpoints store them (transformers fuses the experts in memory only):
    layers.i.mlp.router.weight                 <- model.layers.i.block_sparse_moe.gate.weight
    layers.i.mlp.experts.e.{gate,up,down}_proj <- model.layers.i.block_sparse_moe.experts.e.{w1,w3,w2}
Qwen3-MoE's (model_type qwen3_moe; q / k norms as Qwen3; norm_topk_prob false = no top-k renormalisation,
our moe_router_pre_softmax):
    layers.i.mlp.router.weight                 <- model.layers.i.mlp.gate.weight
    layers.i.mlp.experts.e.{gate,up,down}_proj <- model.layers.i.mlp.experts.e.{gate,up,down}_proj
OLMoE's (model_type olmoe): Qwen3-MoE's names and router (softmax, top-k, renormalised only with
norm_topk_prob, no shared expert; intermediate_size is the experts' width), q / k norms over the whole
projection (our qk_layernorm_scope "projection"); clip_qkv is refused.
DeepSeek-V3 (model_type deepseek_v3, also Moonlight; kimi_k2) keeps HF's attention names, so its
MLA weights map the same way: layers.i.attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj},
layers.i.attn.{kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj} <- model.layers.i.self_attn.*
Its layers from first_k_dense_replace on are MoE (router: fivefold.config.hf._noaux_tc_router):
    layers.i.mlp.router.weight                 <- model.layers.i.mlp.gate.weight
    layers.i.mlp.router.expert_bias (fp32)     <- model.layers.i.mlp.gate.e_score_correction_bias
    layers.i.mlp.experts.e.{gate,up,down}_proj <- model.layers.i.mlp.experts.e.{gate,up,down}_proj
    layers.i.mlp.shared_experts.{gate,up,down}_proj <- model.layers.i.mlp.shared_experts.* (n_shared_experts
                                      x moe_intermediate_size wide)
Its multi-token prediction modules (num_nextn_predict_layers, our model.mtp_num_layers) are stored as
layers past the main ones, j = num_hidden_layers + k - 1 for depth k:
    mtp.<k-1>.{enorm,hnorm,eh_proj}.weight     <- model.layers.j.{enorm,hnorm,eh_proj}.weight
    mtp.<k-1>.final_norm.weight                <- model.layers.j.shared_head.norm.weight
    mtp.<k-1>.layer.<rest>                     <- model.layers.j.<rest> (a decoder layer, named as layer j)
eh_proj's input is [enorm(embedding); hnorm(hidden)], embedding first (Megatron-Core's order, and the one
the inference engines that run DeepSeek-V3's checkpoints use). Each module also stores
model.layers.j.{embed_tokens, shared_head.head}.weight: copies of the main embedding and output layer, which
MTP shares (as DeepSeek-V3 and Megatron train it); they are checked equal to the main ones on import
(`checkmtp_copies`) and written as copies on export. A folder whose config declares MTP layers it does not
hold (some derived checkpoints drop them) imports without MTP; layers past those are named by
`unread_layers` and skipped with a note.
"""
from __future__ import annotations

import torch

from fivefold.config.schema import ModelConfig
from fivefold.errors import UserError


def moe_family(cfg: ModelConfig) -> str:
    """The HF family an MoE config is stored as: DeepSeek-V3 (MLA), Qwen3-MoE (per-head q / k norms),
    OLMoE (q / k norms over the whole projection), else Mixtral."""
    if cfg.multi_latent_attention:
        return "deepseek_v3"
    if not cfg.qk_layernorm:
        return "mixtral"
    return "olmoe" if cfg.qk_layernorm_scope == "projection" else "qwen3_moe"


_MIXTRAL_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


_LAYER_RENAMES = (("attn_norm.", "input_layernorm."), ("attn.", "self_attn."),
                  ("mlp_norm.", "post_attention_layernorm."), ("mlp.", "mlp."))


def _moe_name(rest: str, index: str, cfg: ModelConfig) -> str | None:
    """HF names of our MoE parameters (`rest` after `layers.<i>.`), None for other parameters."""
    mixtral = moe_family(cfg) == "mixtral"
    block = "block_sparse_moe" if mixtral else "mlp"
    if rest == "mlp.router.weight":
        return f"model.layers.{index}.{block}.gate.weight"
    if rest == "mlp.router.expert_bias":  # DeepSeek-V3's (the softmax families have none)
        return f"model.layers.{index}.{block}.gate.e_score_correction_bias"
    parts = rest.split(".")  # mlp.experts.<e>.<proj>.weight
    if parts[:2] == ["mlp", "experts"] and len(parts) == 5:
        proj = _MIXTRAL_PROJ[parts[3]] if mixtral else parts[3]
        return f"model.layers.{index}.{block}.experts.{parts[2]}.{proj}.weight"
    return None


def mtp_copies(cfg: ModelConfig) -> dict[str, list[str]]:
    """Our embedding / output layer -> the HF names of their copies in the MTP modules."""
    layers = range(cfg.num_layers, cfg.num_layers + (cfg.mtp_num_layers or 0))
    embed = [f"model.layers.{j}.embed_tokens.weight" for j in layers]
    heads = [f"model.layers.{j}.shared_head.head.weight" for j in layers]
    if cfg.tie_word_embeddings:
        return {"embedding.weight": embed + heads}
    return {"embedding.weight": embed, "head.weight": heads}


def checkmtp_copies(name: str, part: torch.Tensor, cfg: ModelConfig, read) -> None:
    """`part` of our `name` (the embedding or output layer, whole or a slice) against the same part of each
    MTP module's copy of it, `read(hf_name)` giving that part or None where the checkpoint has no copy.
    A copy that differs is refused: our MTP shares the main one."""
    for copy in mtp_copies(cfg).get(name, ()):
        other = read(copy)
        if other is not None and not torch.equal(other.to(part.dtype), part):
            raise UserError(f"{copy} differs from the main model's {hf_name(name, cfg)}: fivefold's multi-token "
                            "prediction shares the main embedding and output layer, as DeepSeek-V3 and Megatron-Core "
                            "train it, so these weights cannot be imported as they are; set num_nextn_predict_layers "
                            "to 0 in config.json to import the main model without MTP")


def hf_name(name: str, cfg: ModelConfig) -> str:
    """Our parameter name -> the HF Llama tensor name (see the module docstring)."""
    if name == "embedding.weight" or (name == "head.weight" and cfg.tie_word_embeddings):
        return "model.embed_tokens.weight"
    if name == "head.weight":
        return "lm_head.weight"
    if name == "value_head.weight":  # a critic's (Engine(value_head=True)): HF's token-classification head
        return "score.weight"
    if name.startswith("final_norm."):  # weight (and bias with LayerNorm)
        return "model.norm." + name.removeprefix("final_norm.")
    kind, index, rest = name.split(".", 2)  # layers.<i>.<rest> or mtp.<k-1>.<rest>
    if kind == "mtp":  # stored as layer num_hidden_layers + k - 1
        j = cfg.num_layers + int(index)
        if rest.startswith("layer."):
            return hf_name(f"layers.{j}.{rest.removeprefix('layer.')}", cfg)
        return f"model.layers.{j}." + ("shared_head.norm.weight" if rest == "final_norm.weight" else rest)
    moe = _moe_name(rest, index, cfg)
    if moe is not None:
        return moe
    for ours, theirs in _LAYER_RENAMES:
        if rest.startswith(ours):
            return f"model.layers.{index}.{theirs}{rest[len(ours):]}"
    raise KeyError(name)
