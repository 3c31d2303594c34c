"""Our `ModelConfig` -> the config.json of the Hugging Face family that computes the same model (`hf_config`):
Llama (RMSNorm, SwiGLU, RoPE, no biases), Qwen2 / Qwen3, Mixtral, Qwen3-MoE, OLMoE and DeepSeek-V3, the ones
fivefold.config.hf reads back. What no such config can say is refused, not implemented yet."""
from __future__ import annotations

import torch

from fivefold.config.schema import ModelConfig
from fivefold.errors import NotImplementedYet


_HF_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json for `cfg` in the family HF calls it (see the module docstring)."""
    if cfg.normalization != "RMSNorm":
        raise NotImplementedYet(f"Hugging Face export of normalization={cfg.normalization!r} (Llama-family "
                                "exports need RMSNorm)")
    unsaid = [f"{name}={value!r}" for name, value, said in (
        ("activation", cfg.activation, cfg.activation == "swiglu"),
        ("add_bias_linear", cfg.add_bias_linear, not cfg.add_bias_linear),
        ("position_embedding_type", cfg.position_embedding_type, cfg.position_embedding_type == "rope")) if not said]
    if unsaid:  # (until 2026-11-29 written as a Llama config: HF loaded it and computed another model)
        raise NotImplementedYet(f"Hugging Face export of {', '.join(unsaid)} (the Llama-family configs written here "
                                "say SwiGLU MLPs without linear biases and rotary position embeddings)")
    out = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size,
           "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
           "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_epsilon,
           "rope_theta": cfg.rotary_base, "tie_word_embeddings": cfg.tie_word_embeddings,
           "initializer_range": cfg.init_method_std, "hidden_act": "silu", "attention_bias": False,
           "torch_dtype": _HF_DTYPE[dtype], "bos_token_id": None, "eos_token_id": None}
    if cfg.multi_latent_attention:
        if not cfg.qk_layernorm:
            raise NotImplementedYet("Hugging Face export of MLA without the latent norms (qk_layernorm=False): HF's "
                                    "DeepseekV3 always has q_a_layernorm / kv_a_layernorm")
        return {**out, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                "num_key_value_heads": cfg.num_attention_heads, "q_lora_rank": cfg.q_lora_rank,
                "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_head_dim,
                "qk_rope_head_dim": cfg.qk_pos_emb_head_dim, "v_head_dim": cfg.v_head_dim,
                "head_dim": cfg.qk_pos_emb_head_dim, "rope_interleave": True, "rms_norm_eps": cfg.norm_epsilon,
                "num_nextn_predict_layers": cfg.mtp_num_layers or 0, **_deepseek_moe(cfg)}
    if cfg.mtp_num_layers:
        raise NotImplementedYet("Hugging Face export of multi-token prediction layers outside DeepSeek-V3 (MLA) models: "
                                "only DeepSeek-V3's config.json has a place for them (num_nextn_predict_layers)")
    out.update(num_key_value_heads=cfg.num_query_groups or cfg.num_attention_heads, head_dim=cfg.head_dim)
    if cfg.is_moe and (cfg.moe_shared_expert_intermediate_size or cfg.moe_first_k_dense_layers
                       or cfg.moe_router_score_function != "softmax" or cfg.add_qkv_bias
                       or cfg.moe_router_group_topk or cfg.moe_router_topk_scaling_factor not in (None, 1.0)):
        raise NotImplementedYet("Hugging Face export of this MoE (Mixtral's, Qwen3-MoE's and OLMoE's layouts need every layer "
                                "MoE, no shared expert, no QKV bias and a softmax router without groups or top-k "
                                "scaling)")
    if cfg.qk_layernorm and cfg.qk_layernorm_scope == "projection":
        return _olmoe(cfg, out)
    if cfg.is_moe and cfg.qk_layernorm:
        return {**out, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
                "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.moe_router_topk,
                "moe_intermediate_size": cfg.moe_ffn_hidden_size or cfg.ffn_size,
                "norm_topk_prob": not cfg.moe_router_pre_softmax, "decoder_sparse_step": 1, "mlp_only_layers": [],
                "use_sliding_window": False, "router_aux_loss_coef": cfg.moe_aux_loss_coeff}
    if cfg.add_qkv_bias or cfg.qk_layernorm:
        if cfg.add_qkv_bias and cfg.qk_layernorm:
            raise NotImplementedYet("Hugging Face export of QKV biases with q/k norms (Qwen2: biases, Qwen3: q/k norms)")
        kind, arch = ("qwen2", "Qwen2ForCausalLM") if cfg.add_qkv_bias else ("qwen3", "Qwen3ForCausalLM")
        out.pop("attention_bias")
        return {**out, "model_type": kind, "architectures": [arch], "use_sliding_window": False,
                **({"attention_bias": False} if kind == "qwen3" else {})}
    if not cfg.is_moe:
        return {**out, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "mlp_bias": False}
    if cfg.moe_router_pre_softmax:
        raise NotImplementedYet("Hugging Face export of an MoE without top-k renormalisation and without q/k norms "
                                "(Mixtral renormalises; Qwen3-MoE's norm_topk_prob=false needs its q/k norms)")
    return {**out, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
            "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.moe_router_topk,
            "intermediate_size": cfg.moe_ffn_hidden_size or cfg.ffn_size, "router_aux_loss_coef": cfg.moe_aux_loss_coeff}


def _deepseek_moe(cfg: ModelConfig) -> dict:
    """DeepSeek-V3's MoE keys (an all-dense model: one unused expert, first_k_dense_replace = layers).
    HF's DeepseekV3 routes one way only (fivefold.config.hf._deepseek_router): sigmoid scores plus
    e_score_correction_bias for the choice, a group scored by its top 2, shared experts always on."""
    if not cfg.is_moe:
        return {"n_routed_experts": 1, "first_k_dense_replace": cfg.num_layers, "n_shared_experts": 1,
                "num_experts_per_tok": 1, "moe_intermediate_size": cfg.ffn_size}
    f, shared, k = cfg.moe_ffn_hidden_size or cfg.ffn_size, cfg.moe_shared_expert_intermediate_size, cfg.moe_router_topk
    groups, chosen = cfg.moe_router_num_groups or 1, cfg.moe_router_group_topk or 1
    needs = {"moe_router_score_function='sigmoid'": cfg.moe_router_score_function == "sigmoid",
             "moe_router_enable_expert_bias (HF's e_score_correction_bias)": cfg.moe_router_enable_expert_bias,
             f"shared experts a multiple of moe_ffn_hidden_size={f} wide": bool(shared) and shared % f == 0,
             "moe_router_topk // moe_router_group_topk = 2 with groups (HF scores a group by its top 2)":
                 groups == 1 or k // chosen == 2,
             "moe_router_topk > 1 or moe_router_pre_softmax (HF renormalises a single weight to 1)":
                 k > 1 or cfg.moe_router_pre_softmax}
    missing = [what for what, ok in needs.items() if not ok]
    if missing:
        raise NotImplementedYet(f"Hugging Face export of this MLA MoE as DeepSeek-V3, which needs {'; '.join(missing)}")
    return {"n_routed_experts": cfg.num_experts, "num_experts_per_tok": k, "moe_intermediate_size": f,
            "n_shared_experts": shared // f, "first_k_dense_replace": cfg.moe_first_k_dense_layers,
            "n_group": groups, "topk_group": chosen, "norm_topk_prob": not cfg.moe_router_pre_softmax,
            "routed_scaling_factor": cfg.moe_router_topk_scaling_factor or 1.0, "scoring_func": "sigmoid",
            "topk_method": "noaux_tc"}


def _olmoe(cfg: ModelConfig, out: dict) -> dict:
    """OLMoE's config.json: every layer MoE, its q / k norms of widths hidden_size and
    hidden_size / heads * KV heads (so head_dim must be h / a), no clipping, no pad token."""
    if not cfg.is_moe:
        raise NotImplementedYet("Hugging Face export of q / k norms over the whole projection without MoE layers "
                                "(OLMoE has them with MoE layers; OLMo2 with dense ones, but post-norm blocks)")
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise NotImplementedYet(f"Hugging Face export of OLMoE with head_dim={cfg.head_dim} != hidden_size / "
                                f"num_attention_heads = {cfg.hidden_size // cfg.num_attention_heads} (HF's q_norm has "
                                "width hidden_size)")
    out = {k: v for k, v in out.items() if k != "head_dim"}  # OLMoE derives it: h / a
    return {**out, "model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.moe_router_topk, "intermediate_size": cfg.moe_ffn_hidden_size or cfg.ffn_size,
            "norm_topk_prob": not cfg.moe_router_pre_softmax, "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
            "clip_qkv": None, "pad_token_id": None}
