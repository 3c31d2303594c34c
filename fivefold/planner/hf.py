"""A local Hugging Face config.json -> our canonical `ModelConfig`.

Reads the keys of the Llama / Mistral / Mixtral / Qwen2 / Qwen3 (dense and MoE) / OLMoE /
DeepSeek-V2 / DeepSeek-V3 / Kimi-K2 / GLM-4.5 families (DeepSeek-V3's router: `_noaux_tc_router`).
Anything our model cannot express (an MoE layer pattern other than "first k dense, the rest MoE")
is refused with the key that says so.
"""
from __future__ import annotations

import json
from pathlib import Path

from fivefold.config.schema import ModelConfig
from fivefold.errors import UserError


def _need(cfg: dict, key: str, path: str):
    if key not in cfg:
        raise UserError(f"{path}: config.json has no {key!r}; is this a decoder LM config "
                        "(Llama, Mixtral, Qwen2/3(-MoE), DeepSeek-V2/V3)?")
    return cfg[key]


_REQUIRED = object()


def _whole(cfg: dict, key: str, path: str, default=_REQUIRED):
    """A count or size read as a whole number (a float JSON wrote as 32.0 too); required unless a
    `default` is given (for a missing or null key). A fraction, a string or a bool is refused naming
    the key (`int()` truncated 2.7 to 2 layers, silently)."""
    if cfg.get(key) is None and default is not _REQUIRED:
        return default
    value = _need(cfg, key, path)
    if isinstance(value, bool) or not (isinstance(value, int) or isinstance(value, float) and value.is_integer()):
        raise UserError(f"{path}: {key}={value!r} is not a whole number")
    return int(value)


DEEPSEEK_V3 = ("deepseek_v3", "kimi_k2")
"""model_types whose MoE layers route as DeepSeek-V3 (topk_method noaux_tc; Moonlight is deepseek_v3)."""


def _noaux_tc_router(cfg: dict, path: str) -> dict:
    """DeepSeek-V3's router: sigmoid scores, e_score_correction_bias (our expert bias) added for the
    choice only, n_group groups of which each token takes topk_group, top-k renormalised with
    norm_topk_prob, times routed_scaling_factor. One group (Moonlight, Kimi-K2) is no group limit."""
    groups = _whole(cfg, "n_group", path)
    return dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_pre_softmax=not _need(cfg, "norm_topk_prob", path),
                moe_router_topk_scaling_factor=float(_need(cfg, "routed_scaling_factor", path)),
                moe_router_num_groups=groups if groups > 1 else None,
                moe_router_group_topk=_whole(cfg, "topk_group", path) if groups > 1 else None)


def model_from_hf_dict(cfg: dict, path: str = "config.json") -> ModelConfig:
    """Translate a parsed config.json (see the module docstring for the families read)."""
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = cfg["text_config"]
    h = _whole(cfg, "hidden_size", path)
    heads = _whole(cfg, "num_attention_heads", path)
    kw: dict = dict(
        num_layers=_whole(cfg, "num_hidden_layers", path), hidden_size=h, num_attention_heads=heads,
        num_query_groups=_whole(cfg, "num_key_value_heads", path, None) or heads,
        vocab_size=_whole(cfg, "vocab_size", path), ffn_hidden_size=_whole(cfg, "intermediate_size", path),
        max_position_embeddings=_whole(cfg, "max_position_embeddings", path, 4096),
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-5)), rotary_base=float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        init_method_std=float(cfg.get("initializer_range", 0.02)),
    )
    kw["kv_channels"] = _whole(cfg, "head_dim", path, None) or h // heads
    if "kv_lora_rank" in cfg:  # DeepSeek-V2/V3, Kimi-K2, Moonlight: multi-head latent attention
        nope, rope = _whole(cfg, "qk_nope_head_dim", path), _whole(cfg, "qk_rope_head_dim", path)
        kw.update(multi_latent_attention=True, q_lora_rank=_whole(cfg, "q_lora_rank", path, None),
                  kv_lora_rank=_whole(cfg, "kv_lora_rank", path), qk_head_dim=nope, qk_pos_emb_head_dim=rope,
                  v_head_dim=_whole(cfg, "v_head_dim", path), num_query_groups=None, qk_layernorm=True,  # latent norms
                  kv_channels=nope + rope)
    key = next((k for k in ("num_local_experts", "n_routed_experts", "num_experts") if cfg.get(k)), None)
    experts = _whole(cfg, key, path) if key else None
    if experts:
        moe_ffn = _whole(cfg, "moe_intermediate_size", path, None) or kw["ffn_hidden_size"]
        shared = 0
        if cfg.get("n_shared_experts"):
            shared = _whole(cfg, "n_shared_experts", path) * moe_ffn
        elif cfg.get("shared_expert_intermediate_size"):
            shared = _whole(cfg, "shared_expert_intermediate_size", path)
        first_dense = _whole(cfg, "first_k_dense_replace", path, None) or 0
        step = _whole(cfg, "decoder_sparse_step", path, None) or _whole(cfg, "moe_layer_freq", path, None) or 1
        if step != 1 or cfg.get("mlp_only_layers"):
            raise UserError(f"{path}: MoE layer pattern decoder_sparse_step={step}, "
                            f"mlp_only_layers={cfg.get('mlp_only_layers')} is not supported "
                            "(only 'first k layers dense, the rest MoE')")
        kw.update(num_experts=experts, moe_router_topk=_whole(cfg, "num_experts_per_tok", path),
                  moe_ffn_hidden_size=moe_ffn, moe_shared_expert_intermediate_size=shared or None,
                  moe_first_k_dense_layers=first_dense,
                  moe_router_score_function=str(cfg.get("scoring_func", "softmax")))
        if cfg.get("model_type") in DEEPSEEK_V3 or cfg.get("topk_method") == "noaux_tc":
            kw.update(_noaux_tc_router(cfg, path))
    if cfg.get("num_nextn_predict_layers"):  # DeepSeek-V3's MTP modules, trained as Megatron does (--mtp-num-layers)
        kw.update(mtp_num_layers=_whole(cfg, "num_nextn_predict_layers", path))
    try:
        return ModelConfig(**kw)
    except (TypeError, ValueError) as e:
        raise UserError(f"{path}: cannot read as a model config: {e}") from e


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def load_hf_config(path: str | Path) -> ModelConfig:
    """Read a local config.json (or a folder holding one); UserError when missing or malformed."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise UserError(f"{path}: no such config.json")
    try:
        cfg = json.loads(p.read_text(), object_pairs_hook=_no_duplicate_keys)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{p}: malformed JSON ({e})") from e
    except _DuplicateKey as e:  # json keeps the last silently; which one the writer meant is unknown
        raise UserError(f"{p}: key {e.args[0]!r} given twice: keep one") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{p}: expected a JSON object, got {type(cfg).__name__}")
    try:
        return model_from_hf_dict(cfg, str(p))
    except (TypeError, ValueError, KeyError) as e:
        raise UserError(f"{p}: cannot read as a model config: {e}") from e
