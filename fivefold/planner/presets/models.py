"""Model presets: the architectures the seeds name, from each model's published config.json.

Each preset is our canonical `ModelConfig` (field names after Megatron-Core) plus the parameter
counts the model's authors publish, with where they publish them, so that a test can hold our
parameter-count formula to them. HF config keys map as: hidden_size -> hidden_size,
intermediate_size -> ffn_hidden_size, num_key_value_heads -> num_query_groups, head_dim ->
kv_channels, moe_intermediate_size -> moe_ffn_hidden_size, n_shared_experts * moe_intermediate_size
-> moe_shared_expert_intermediate_size, first_k_dense_replace -> moe_first_k_dense_layers,
num_experts_per_tok -> moe_router_topk (see `fivefold.config.hf`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from fivefold.config.schema import ModelConfig
from fivefold.errors import UserError


@dataclass(frozen=True)
class ModelPreset:
    name: str
    model: ModelConfig
    hf_id: str
    """Where the config.json is published (Hugging Face repository)."""
    published_total: float
    """Total parameters the authors publish (excluding multi-token-prediction modules)."""
    published_active: float
    """Parameters active per token the authors publish (= total for dense models)."""
    source: str
    """Where the two published figures are stated."""
    notes: str = ""
    """Architecture details our ModelConfig does not carry (parameter-negligible), and MTP."""
    excludes_embedding: bool = False
    """The published figures leave out the input embedding and the output layer."""


def _llama(layers, h, ffn, heads, kv, vocab=128256, theta=500000.0) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=h, ffn_hidden_size=ffn, num_attention_heads=heads,
                       num_query_groups=kv, kv_channels=h // heads, vocab_size=vocab,
                       max_position_embeddings=131072, rotary_base=theta, norm_epsilon=1e-5)


def _deepseek(layers, h, ffn, heads, q_lora, experts, topk, moe_ffn, shared, first_dense, vocab,
              score="softmax") -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=h, ffn_hidden_size=ffn, num_attention_heads=heads,
                       vocab_size=vocab, multi_latent_attention=True, qk_layernorm=True, q_lora_rank=q_lora, kv_lora_rank=512,
                       qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, kv_channels=192,
                       num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=moe_ffn,
                       moe_shared_expert_intermediate_size=shared * moe_ffn, moe_first_k_dense_layers=first_dense,
                       moe_router_score_function=score, norm_epsilon=1e-6, max_position_embeddings=163840)


def _qwen3_moe(layers, h, heads, kv, experts, moe_ffn, vocab=151936) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=h, ffn_hidden_size=moe_ffn, num_attention_heads=heads,
                       num_query_groups=kv, kv_channels=128, vocab_size=vocab, num_experts=experts,
                       moe_router_topk=8, moe_ffn_hidden_size=moe_ffn, rotary_base=1e6, norm_epsilon=1e-6,
                       max_position_embeddings=40960)


def _glm45(layers, h, ffn, experts, moe_ffn, first_dense) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=h, ffn_hidden_size=ffn, num_attention_heads=96,
                       num_query_groups=8, kv_channels=128, vocab_size=151552, num_experts=experts,
                       moe_router_topk=8, moe_ffn_hidden_size=moe_ffn, moe_shared_expert_intermediate_size=moe_ffn,
                       moe_first_k_dense_layers=first_dense, moe_router_score_function="sigmoid",
                       rotary_base=1e6, max_position_embeddings=131072)


def _megatron_gpt(layers, h, heads) -> ModelConfig:
    """A model of Megatron-LM's weak-scaling table: GPT (LayerNorm, GeLU 4h MLP, MHA, untied output
    layer; the counts match only untied) with the 131,072-token vocabulary its text states."""
    return ModelConfig(num_layers=layers, hidden_size=h, ffn_hidden_size=4 * h, num_attention_heads=heads,
                       kv_channels=h // heads, vocab_size=131072, activation="gelu", normalization="LayerNorm",
                       add_bias_linear=True, max_position_embeddings=4096)


_MLM_TABLE = ("Megatron-LM README, 'Performance Benchmarking' weak-scaling table (images/model_table.png, commit "
              "f2e5db4): model size column")
_MLM_GPT = [ModelPreset(f"mlm-gpt-{size.lower()}", _megatron_gpt(layers, h, heads), "-", float(size[:-1]) * 1e9,
                        float(size[:-1]) * 1e9, _MLM_TABLE,
                        notes="no config.json is published; shape from the table, vocabulary from the text")
            for size, layers, h, heads in (("1.7B", 24, 2048, 16), ("7.1B", 30, 4096, 32), ("16B", 32, 6144, 48),
                                           ("32B", 48, 7168, 56), ("70B", 84, 8192, 64), ("119B", 92, 10240, 80),
                                           ("177B", 96, 12288, 96), ("314B", 96, 16384, 128),
                                           ("462B", 112, 18432, 144))]

_PRESETS = [*_MLM_GPT,
    ModelPreset("llama3-8b", _llama(32, 4096, 14336, 32, 8), "meta-llama/Meta-Llama-3-8B", 8.03e9, 8.03e9,
                "Hugging Face model card of meta-llama/Meta-Llama-3-8B: 'Model size 8.03B params' (safetensors)"),
    ModelPreset("llama3-70b", _llama(80, 8192, 28672, 64, 8), "meta-llama/Meta-Llama-3-70B", 70.6e9, 70.6e9,
                "Hugging Face model card of meta-llama/Meta-Llama-3-70B: 'Model size 70.6B params' (safetensors)"),
    ModelPreset("llama3-405b", _llama(126, 16384, 53248, 128, 8), "meta-llama/Llama-3.1-405B", 406e9, 406e9,
                "Hugging Face model card of meta-llama/Llama-3.1-405B: 'Model size 406B params' (safetensors)"),
    ModelPreset("mixtral-8x7b",
                ModelConfig(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                            num_query_groups=8, kv_channels=128, vocab_size=32000, num_experts=8, moe_router_topk=2,
                            moe_ffn_hidden_size=14336, rotary_base=1e6, max_position_embeddings=32768),
                "mistralai/Mixtral-8x7B-v0.1", 46.7e9, 12.9e9,
                "Mistral AI, 'Mixtral of experts' (blog, Dec 2023): '46.7B total parameters but only uses 12.9B "
                "parameters per token'"),
    ModelPreset("olmoe-1b-7b",
                ModelConfig(num_layers=16, hidden_size=2048, ffn_hidden_size=1024, num_attention_heads=16,
                            num_query_groups=16, kv_channels=128, vocab_size=50304, num_experts=64, moe_router_topk=8,
                            moe_ffn_hidden_size=1024, max_position_embeddings=4096, qk_layernorm=True,
                            qk_layernorm_scope="projection"),
                "allenai/OLMoE-1B-7B-0924", 6.9e9, 1.3e9,
                "Muennighoff et al., 'OLMoE: Open Mixture-of-Experts Language Models' (2024), Table 1: "
                "6.9B total, 1.3B active parameters"),
    ModelPreset("moonlight-16b-a3b",
                _deepseek(27, 2048, 11264, 16, None, 64, 6, 1408, 2, 1, 163840, score="sigmoid"),
                "moonshotai/Moonlight-16B-A3B", 15.29e9, 2.24e9,
                "moonshotai/Moonlight README, comparison table: 'Activated Params 2.24B, Total Params 15.29B', "
                "footnote: 'The reported parameter counts exclude the embedding parameters'",
                excludes_embedding=True),
    ModelPreset("deepseek-v2",
                _deepseek(60, 5120, 12288, 128, 1536, 160, 6, 1536, 2, 1, 102400),
                "deepseek-ai/DeepSeek-V2", 236e9, 21e9,
                "DeepSeek-AI, 'DeepSeek-V2' (2024), abstract: '236B total parameters, of which 21B are activated "
                "for each token'"),
    ModelPreset("deepseek-v3",
                replace(_deepseek(61, 7168, 18432, 128, 1536, 256, 8, 2048, 1, 3, 129280, score="sigmoid"),
                        mtp_num_layers=1, moe_router_num_groups=8, moe_router_group_topk=4),
                "deepseek-ai/DeepSeek-V3", 671e9, 37e9,
                "DeepSeek-AI, 'DeepSeek-V3 Technical Report' (2024), abstract: '671B total parameters with 37B "
                "activated for each token' (the 14B multi-token-prediction module is excluded)",
                notes="trains its MTP module (1 layer, as config.json's num_nextn_predict_layers and Megatron-Core's "
                      "DeepSeek-V3 recipe, --mtp-num-layers 1): counted in memory, time and FLOPs; the published "
                      "671B / 37B exclude it, as the counts here do; node-limited routing as config.json's "
                      "n_group 8 / topk_group 4 (each token's 8 experts from 4 of 8 expert groups)"),
    ModelPreset("qwen3-30b-a3b", _qwen3_moe(48, 2048, 32, 4, 128, 768), "Qwen/Qwen3-30B-A3B", 30.5e9, 3.3e9,
                "Hugging Face model card of Qwen/Qwen3-30B-A3B: 'Number of Parameters: 30.5B in total and 3.3B "
                "activated'", notes="QK-norm (2 x head_dim per layer), not modelled"),
    ModelPreset("qwen3-235b-a22b", _qwen3_moe(94, 4096, 64, 4, 128, 1536), "Qwen/Qwen3-235B-A22B", 235e9, 22e9,
                "Hugging Face model card of Qwen/Qwen3-235B-A22B: 'Number of Parameters: 235B in total and 22B "
                "activated'", notes="QK-norm (2 x head_dim per layer), not modelled"),
    ModelPreset("glm-4.5", _glm45(92, 5120, 12288, 160, 1536, 3), "zai-org/GLM-4.5", 355e9, 32e9,
                "zai-org/GLM-4.5 README: 'GLM-4.5 has 355 billion total parameters with 32 billion active "
                "parameters'",
                notes="QKV bias and QK-norm (< 0.01% of parameters), partial RoPE (0.5): not modelled; "
                      "its 1 MTP layer excluded. The README does not say whether embeddings are counted; "
                      "the active figure matches only without them (with them: 33.6B)",
                excludes_embedding=True),
    ModelPreset("glm-4.5-air", _glm45(46, 4096, 10944, 128, 1408, 1), "zai-org/GLM-4.5-Air", 106e9, 12e9,
                "zai-org/GLM-4.5 README: 'GLM-4.5-Air ... 106 billion total parameters and 12 billion active "
                "parameters'", notes="QKV bias (< 0.01%), partial RoPE: not modelled; its 1 MTP layer excluded. "
                "The active figure matches only without embeddings (with them: 13.4B)", excludes_embedding=True),
    ModelPreset("kimi-k2", _deepseek(61, 7168, 18432, 64, 1536, 384, 8, 2048, 1, 1, 163840, score="sigmoid"),
                "moonshotai/Kimi-K2-Base", 1.04e12, 32.6e9,
                "Kimi Team, 'Kimi K2: Open Agentic Intelligence' (2025), Table 2 / model card: 1.04T total "
                "parameters, 32.6B activated"),
]

ALIASES = {
    "llama-3-8b": "llama3-8b", "llama3-8b": "llama3-8b", "llama-3-70b": "llama3-70b", "llama-3-405b": "llama3-405b",
    "llama3.1-405b": "llama3-405b", "mixtral": "mixtral-8x7b", "olmoe": "olmoe-1b-7b", "moonlight": "moonlight-16b-a3b",
    "deepseek-v2-236b": "deepseek-v2", "deepseek-v3-671b": "deepseek-v3", "qwen3-30b": "qwen3-30b-a3b",
    "qwen3-235b": "qwen3-235b-a22b", "glm4.5": "glm-4.5", "glm-4.5-355b": "glm-4.5", "glm4.5-air": "glm-4.5-air",
    "kimi-k2-1t": "kimi-k2",
}

MODEL_PRESETS: dict[str, ModelPreset] = {p.name: p for p in _PRESETS}


def model_preset(name: str) -> ModelPreset:
    """The preset called `name` (case-insensitive, aliases allowed); UserError listing them otherwise."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in MODEL_PRESETS:
        raise UserError(f"unknown model preset {name!r}; known: {', '.join(MODEL_PRESETS)} "
                        "(or give a path to a Hugging Face config.json, or a fivefold YAML config)")
    return MODEL_PRESETS[key]
