"""A local Hugging Face model folder's config.json -> our canonical `ModelConfig`, without torch.

    load_hf_config(path)     the key translation (config.json or a folder holding one), shared with the
                             planner (`plan --model DIR`)
    config_from_hf(dir)      that, checked against what our model computes as HF does (families, routers,
                             RoPE, biases, quantization) and with the MTP layers the weights hold
    weight_files(dir)        HF tensor name -> the safetensors file holding it (index or header)

Reads the keys of the Llama / Mistral / Mixtral / Qwen2 / Qwen3 (dense and MoE) / OLMoE /
DeepSeek-V2 / DeepSeek-V3 / Kimi-K2 / GLM-4.5 families (DeepSeek-V3's router: `_noaux_tc_router`).
Anything our model cannot express (an MoE layer pattern other than "first k dense, the rest MoE")
is refused with the key that says so. The weights themselves are read by fivefold.hf.
"""
from __future__ import annotations

import json
from dataclasses import fields, replace
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


INDEX = "model.safetensors.index.json"


SINGLE = "model.safetensors"


def hf_folder(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"{path}: not a directory (expected a Hugging Face checkpoint folder with "
                        f"config.json and {SINGLE} or {INDEX})")
    return p


def config_from_hf(path: str | Path) -> ModelConfig:
    """A Llama-family config.json -> ModelConfig; UserError naming the key our model cannot express."""
    d = hf_folder(path)
    cfg = load_hf_config(d)  # the key translation, shared with the planner
    raw = json.loads((d / "config.json").read_text())
    where = d / "config.json"
    kind = raw.get("model_type")
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise UserError(f"{where}: quantization_config (quant_method={method!r}): quantized weights (e.g. fp8 "
                        "with weight_scale_inv) are not dequantized here; convert the checkpoint to bf16 first "
                        "(DeepSeek-V3's inference/fp8_cast_bf16.py does) and drop quantization_config")
    if kind not in ("llama", "mistral", "mixtral", *ATTENTION_ADDS, *DEEPSEEK):
        raise UserError(f"{where}: model_type={kind!r}; only Llama-style models (llama, mistral, mixtral, "
                        f"{', '.join(ATTENTION_ADDS)}) and DeepSeek-V3-style MLA models ({', '.join(DEEPSEEK)}) "
                        "are imported")
    if kind in DEEPSEEK:
        cfg = _deepseek(raw, cfg, where)
    if kind in ATTENTION_ADDS:
        cfg = replace(cfg, **ATTENTION_ADDS[kind])
    if kind == "olmoe":
        _check_olmoe(raw, cfg, where)
    window = raw.get("sliding_window") if raw.get("use_sliding_window", kind not in QWEN) else None
    checks = {"hidden_act": (raw.get("hidden_act", "silu"), "silu"),
              "attention_bias": (bool(raw.get("attention_bias", False)), False),
              "mlp_bias": (bool(raw.get("mlp_bias", False)), False),
              "sliding_window": (window, None)}
    for key, (value, wanted) in checks.items():
        if value != wanted:
            raise UserError(f"{where}: {key}={value!r} is not supported (our decoder needs {wanted!r})")
    # transformers >= 5 writes rope_parameters {"rope_type", "rope_theta"} (theta read by model_from_hf_dict);
    # older files rope_theta / rope_scaling.
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise UserError(f"{where}: RoPE scaling rope_type={rope_type!r} is not supported (only plain RoPE)")
    if kind == "mixtral":  # softmax over all experts, top-k renormalised (no norm_topk_prob switch)
        cfg = replace(cfg, moe_router_score_function="softmax", moe_router_pre_softmax=False)
    if kind in ("qwen3_moe", "olmoe"):  # softmax over all experts, top-k; renormalised only with norm_topk_prob
        cfg = replace(cfg, moe_router_score_function="softmax",
                      moe_router_pre_softmax=not raw.get("norm_topk_prob", False))
    # MTP modules: DeepSeek-V3's layout only (the planner reads num_nextn_predict_layers from any config)
    return replace(cfg, mtp_num_layers=_mtp_layers(raw, cfg, d) if kind in DEEPSEEK else None)


def _check_olmoe(raw: dict, cfg: ModelConfig, where: Path) -> None:
    """What HF's OLMoE computes beyond our model: clipped q / k / v, and q / k norms whose widths
    (hidden_size, and hidden_size / heads * KV heads) are the projections' only when head_dim = h / a."""
    if raw.get("clip_qkv") is not None:
        raise UserError(f"{where}: clip_qkv={raw['clip_qkv']} is not supported (our attention does not clamp "
                        "q, k, v; OLMoE checkpoints have clip_qkv null)")
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise UserError(f"{where}: head_dim={cfg.head_dim} with hidden_size={cfg.hidden_size} and "
                        f"num_attention_heads={cfg.num_attention_heads}: OLMoE's q_norm has width hidden_size, "
                        "which is the query projection's only when head_dim = hidden_size / num_attention_heads")


ATTENTION_ADDS = {"qwen2": {"add_qkv_bias": True}, "qwen3": {"qk_layernorm": True}, "qwen3_moe": {"qk_layernorm": True},
                  "olmoe": {"qk_layernorm": True, "qk_layernorm_scope": "projection"}}
"""Llama-like model_types and what their attention adds: Qwen2 biases on q, k, v (always); Qwen3 per-head
q / k RMSNorm; OLMoE q / k RMSNorm over the whole projection."""


QWEN = ("qwen2", "qwen3", "qwen3_moe")
"""model_types whose config.json switches sliding_window with use_sliding_window (default off)."""


DEEPSEEK = ("deepseek_v3", "kimi_k2")
"""model_types with DeepseekV3's MLA layout."""


def _deepseek(raw: dict, cfg: ModelConfig, where: Path) -> ModelConfig:
    """A DeepSeek-V3-style config checked for what our MLA decoder and router compute as HF does; with
    every layer dense (first_k_dense_replace >= num_hidden_layers) the unused expert keys are dropped."""
    if cfg.is_moe and cfg.moe_first_k_dense_layers >= cfg.num_layers:
        dense = ModelConfig()
        cfg = replace(cfg, **{f.name: getattr(dense, f.name) for f in fields(cfg)
                              if f.name == "num_experts" or f.name.startswith("moe_")})
    if cfg.is_moe:
        cfg = _deepseek_router(raw, cfg, where)
    if not raw.get("rope_interleave", True):
        raise UserError(f"{where}: rope_interleave=false is not supported (our MLA rotates DeepSeek's "
                        "interleaved pairs, HF's default rope_interleave=true)")
    if float(raw.get("rms_norm_eps", 1e-6)) != 1e-6:
        raise UserError(f"{where}: rms_norm_eps={raw['rms_norm_eps']} with MLA: HF's q_a_layernorm / kv_a_layernorm "
                        "always use 1e-6 and ours use rms_norm_eps for every norm, so only rms_norm_eps=1e-6 "
                        "(every DeepSeek-V3, Moonlight and Kimi-K2 checkpoint) imports exactly")
    return cfg


def _deepseek_router(raw: dict, cfg: ModelConfig, where: Path) -> ModelConfig:
    """What HF's DeepseekV3TopkRouter computes that our router must match: always sigmoid scores and
    the noaux_tc choice (scores + e_score_correction_bias), a group scored by the sum of its top 2
    (ours: of its top k // topk_group), the top-k renormalised also for k = 1 (ours from k = 2), and
    the linear in fp32 (our moe_router_dtype fp32)."""
    for key, wanted in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if raw.get(key, wanted) != wanted:
            raise UserError(f"{where}: {key}={raw[key]!r}: DeepSeek-V3's MoE layers route with {key}={wanted!r} "
                            "(HF's DeepseekV3TopkRouter computes nothing else), so these weights would be routed "
                            "otherwise than they were trained")
    k, groups = cfg.moe_router_topk, cfg.moe_router_num_groups
    if groups and (cfg.num_experts % groups or k // cfg.moe_router_group_topk != 2):
        raise UserError(f"{where}: n_group={groups}, topk_group={cfg.moe_router_group_topk} with n_routed_experts="
                        f"{cfg.num_experts}, num_experts_per_tok={k}: HF scores each of n_group equal groups by its "
                        "top-2 experts and ours by its top num_experts_per_tok // topk_group, so import needs "
                        "n_routed_experts divisible by n_group and num_experts_per_tok // topk_group = 2 "
                        "(DeepSeek-V3: 256 experts, n_group 8, topk_group 4, top-8), or n_group 1")
    if k == 1 and not cfg.moe_router_pre_softmax:
        raise UserError(f"{where}: num_experts_per_tok=1 with norm_topk_prob=true: HF renormalises the single "
                        "weight to 1, ours (as Megatron's) keeps the sigmoid score; set norm_topk_prob false or "
                        "num_experts_per_tok > 1")
    return replace(cfg, moe_router_dtype="fp32")


def _stored_layers(d: Path, start: int) -> list[int]:
    """Indices >= start of the model.layers.<i>.* the folder's weights hold."""
    found = set()
    for name in weight_files(d):
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= start:
            found.add(int(parts[2]))
    return sorted(found)


def _mtp_layers(raw: dict, cfg: ModelConfig, d: Path) -> int | None:
    """DeepSeek-V3's num_nextn_predict_layers as our mtp_num_layers: None when it is 0 or the weights hold
    none of those layers (imported without MTP, with a note: `unread_note`)."""
    n = int(raw.get("num_nextn_predict_layers") or 0)
    has_weights = (d / INDEX).is_file() or (d / SINGLE).is_file()  # a config without weights: none to read
    stored = _stored_layers(d, cfg.num_layers) if n and has_weights else []
    if not stored:
        return None
    wanted = list(range(cfg.num_layers, cfg.num_layers + n))
    if stored[:n] != wanted:
        raise UserError(f"{d}: config.json's num_nextn_predict_layers={n} declares the multi-token prediction layers "
                        f"model.layers.{wanted[0]}..{wanted[-1]}, but the weights hold layers {stored}; give a folder "
                        "with all of them, or set num_nextn_predict_layers to the ones it holds")
    return n


def unread_layers(path: str | Path, cfg: ModelConfig) -> list[int]:
    """Indices of the layers stored past the main ones and the MTP modules the config imports (e.g. MTP
    layers of a config that declares none), which the importer does not read."""
    return _stored_layers(hf_folder(path), cfg.num_layers + (cfg.mtp_num_layers or 0))


def unread_note(path: str | Path, cfg: ModelConfig) -> str | None:
    """The note printed when `path` holds layers we skip (see `unread_layers`), else None."""
    layers = unread_layers(path, cfg)
    if not layers:
        return None
    return (f"{path}: skipping {len(layers)} layer(s) past num_hidden_layers={cfg.num_layers} and the "
            f"{cfg.mtp_num_layers or 0} multi-token prediction layer(s) config.json declares "
            f"(num_nextn_predict_layers) (model.layers.{','.join(map(str, layers))}.*); the model loads without them")


def weight_files(d: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    if (d / INDEX).is_file():
        try:
            weight_map = json.loads((d / INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"{d / INDEX}: not a safetensors index (need a 'weight_map' object): {e}") from e
        return {name: d / file for name, file in weight_map.items()}
    if (d / SINGLE).is_file():
        return {name: d / SINGLE for name in safetensors_names(d / SINGLE)}
    pickled = [p.name for p in d.glob("*.bin")] + [p.name for p in d.glob("*.pt")]
    hint = (f"; found {', '.join(sorted(pickled))}, which are pickles (they can run code when loaded) — "
            "re-save with save_pretrained(..., safe_serialization=True)") if pickled else ""
    raise UserError(f"{d}: no {SINGLE} or {INDEX}{hint}")


def safetensors_names(path: Path) -> list[str]:
    """The tensor names of a safetensors file, read from its header (8 bytes of little-endian length, then
    that much JSON) without loading torch; UserError naming the file when the header is damaged."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= min(path.stat().st_size - 8, 100 * 2**20):
                raise ValueError(f"header length {size} does not fit the file's {path.stat().st_size} bytes")
            header = json.loads(f.read(size))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not a readable safetensors file ({e})") from e
    return [name for name in header if name != "__metadata__"]
