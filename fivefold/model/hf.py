"""Import a local Hugging Face Llama / Mistral / Mixtral / Qwen2 / Qwen3 / Qwen3-MoE / OLMoE or DeepSeek-V3 checkpoint
directory (config.json + safetensors) — no network.

    config_from_hf(dir)            config.json -> ModelConfig (refuses what our model cannot express)
    state_dict_from_hf(dir, cfg)   safetensors (single file or sharded index) -> our parameter names
    load_hf(dir, **kw)             -> Decoder(cfg, **kw) holding the checkpoint's weights

Only safetensors are read: pickled `pytorch_model.bin` files can run code when loaded.
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
Its layers from first_k_dense_replace on are MoE (router: planner.hf._noaux_tc_router):
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

import json
from collections import defaultdict
from dataclasses import fields, replace
from collections.abc import Iterable
from pathlib import Path

import torch

from fivefold.checkpoint.io import tensors_saved
from fivefold.config.schema import ModelConfig
from fivefold.errors import UserError
from fivefold.model.block import DecoderLayer
from fivefold.model.decoder import Decoder
from fivefold.model.init import VOCAB_PARAMS
from fivefold.model.mtp import MTPLayer
from fivefold.parallel.tensor import TPMode, shard_state_dict
from fivefold.planner.hf import load_hf_config

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_MIXTRAL_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_LAYER_RENAMES = (("attn_norm.", "input_layernorm."), ("attn.", "self_attn."),
                  ("mlp_norm.", "post_attention_layernorm."), ("mlp.", "mlp."))


def _dir(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"{path}: not a directory (expected a Hugging Face checkpoint folder with "
                        f"config.json and {SINGLE} or {INDEX})")
    return p


def config_from_hf(path: str | Path) -> ModelConfig:
    """A Llama-family config.json -> ModelConfig; UserError naming the key our model cannot express."""
    d = _dir(path)
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
    # transformers >= 5 writes rope_parameters {"rope_type", "rope_theta"} (theta read by planner.hf);
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


def moe_family(cfg: ModelConfig) -> str:
    """The HF family an MoE config is stored as: DeepSeek-V3 (MLA), Qwen3-MoE (per-head q / k norms),
    OLMoE (q / k norms over the whole projection), else Mixtral."""
    if cfg.multi_latent_attention:
        return "deepseek_v3"
    if not cfg.qk_layernorm:
        return "mixtral"
    return "olmoe" if cfg.qk_layernorm_scope == "projection" else "qwen3_moe"


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
    for name in _weight_files(d):
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
    return _stored_layers(_dir(path), cfg.num_layers + (cfg.mtp_num_layers or 0))


def unread_note(path: str | Path, cfg: ModelConfig) -> str | None:
    """The note printed when `path` holds layers we skip (see `unread_layers`), else None."""
    layers = unread_layers(path, cfg)
    if not layers:
        return None
    return (f"{path}: skipping {len(layers)} layer(s) past num_hidden_layers={cfg.num_layers} and the "
            f"{cfg.mtp_num_layers or 0} multi-token prediction layer(s) config.json declares "
            f"(num_nextn_predict_layers) (model.layers.{','.join(map(str, layers))}.*); the model loads without them")


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


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our full parameter (and saved buffer: the expert bias) names -> the shape HF stores (vocabulary
    unpadded)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    shapes = {"embedding.weight": (v, h)}
    for i in range(cfg.num_layers):
        with torch.device("meta"):
            layer = DecoderLayer(cfg, layer=i)  # dense or MoE (first_k_dense)
        shapes.update({f"layers.{i}.{n}": tuple(p.shape) for n, p in tensors_saved(layer).items()})
    shapes.update({"final_norm.weight": (h,), "head.weight": (v, h)})
    for k in range(cfg.mtp_num_layers or 0):
        with torch.device("meta"):
            module = MTPLayer(cfg, None, TPMode.ALL_REDUCE, depth=k + 1)
        shapes.update({f"mtp.{k}.{n}": tuple(p.shape) for n, p in tensors_saved(module).items()})
    return shapes


def _weight_files(d: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    from safetensors import safe_open

    if (d / INDEX).is_file():
        try:
            weight_map = json.loads((d / INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"{d / INDEX}: not a safetensors index (need a 'weight_map' object): {e}") from e
        return {name: d / file for name, file in weight_map.items()}
    if (d / SINGLE).is_file():
        try:
            with safe_open(str(d / SINGLE), framework="pt") as f:
                return {name: d / SINGLE for name in f.keys()}
        except Exception as e:  # safetensors raises its own error types for a damaged header
            raise UserError(f"{d / SINGLE}: not a readable safetensors file ({e})") from e
    pickled = [p.name for p in d.glob("*.bin")] + [p.name for p in d.glob("*.pt")]
    hint = (f"; found {', '.join(sorted(pickled))}, which are pickles (they can run code when loaded) — "
            "re-save with save_pretrained(..., safe_serialization=True)") if pickled else ""
    raise UserError(f"{d}: no {SINGLE} or {INDEX}{hint}")


def state_dict_from_hf(path: str | Path, cfg: ModelConfig, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Our name -> fp32 tensor for `names` (default: the whole model), vocabulary matrices zero-padded
    to cfg.padded_vocab_size(). Reads only the tensors asked for, file by file."""
    d = _dir(path)
    shapes = _expected_shapes(cfg)
    wanted = list(shapes) if names is None else list(names)
    files = _weight_files(d)
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in wanted:
        theirs = hf_name(name, cfg)
        if theirs not in files:
            raise UserError(f"{d}: no tensor {theirs!r} in the checkpoint (needed for our {name}); "
                            "do config.json and the weights belong together?")
        by_file[files[theirs]].append(name)
    out = _read(by_file, shapes, cfg)
    for name in ("embedding.weight", "head.weight"):
        if name in out:
            checkmtp_copies(name, out[name][: cfg.vocab_size], cfg, lambda copy: _part(files, copy, slice(None)))
    return out


def _part(files: dict[str, Path], theirs: str, index) -> torch.Tensor | None:
    """Tensor `theirs` indexed by `index` (a slice or tuple of slices), read alone; None if not stored."""
    from safetensors import safe_open

    if theirs not in files:
        return None
    with safe_open(str(files[theirs]), framework="pt") as f:
        return f.get_slice(theirs)[index]


def _read(by_file: dict[Path, list[str]], shapes: dict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        if not file.is_file():
            raise UserError(f"{file.parent / INDEX}: lists {file.name}, which is missing")
        try:
            with safe_open(str(file), framework="pt") as f:
                present = set(f.keys())
                for name in names:
                    if hf_name(name, cfg) not in present:
                        raise UserError(f"{file}: has no tensor {hf_name(name, cfg)!r}, which the index puts there")
                    t = f.get_tensor(hf_name(name, cfg)).float()
                    if tuple(t.shape) != shapes[name]:
                        raise UserError(f"{file}: {hf_name(name, cfg)} has shape {list(t.shape)}, "
                                        f"config.json implies {list(shapes[name])}")
                    if name in VOCAB_PARAMS:
                        pad = cfg.padded_vocab_size() - t.shape[0]
                        t = torch.cat([t, t.new_zeros(pad, t.shape[1])])  # padded rows are zero
                    out[name] = t
        except UserError:
            raise
        except Exception as e:  # a damaged file: safetensors' own error types
            raise UserError(f"{file}: not a readable safetensors file ({e})") from e
    return out


def read_hf_shards(model: torch.nn.Module, path: str | Path, cfg: ModelConfig) -> None:
    """Fill every parameter of `model` (this rank's TP / EP / PP share of it, placed by its
    ParamMeta) and its saved buffers (the expert bias, whole) from the HF folder, reading only the
    rows and columns it holds (safetensors slices); padded vocabulary rows zero."""
    from safetensors import safe_open

    from fivefold.checkpoint.io import placed_by_meta

    d = _dir(path)
    files = _weight_files(d)
    shard_of = placed_by_meta(model)
    shapes = _expected_shapes(cfg)
    with torch.no_grad():
        for name, p in tensors_saved(model).items():
            theirs = hf_name(name, cfg)
            if theirs not in files:
                raise UserError(f"{d}: no tensor {theirs!r} (needed for our {name}); do config.json and the "
                                "weights belong together?")
            spec = shard_of(name, p)
            full = shapes[name]
            rows = [(o, min(o + n, g)) for o, n, g in zip(spec.offsets, p.shape, full)]  # padding is past g
            try:
                with safe_open(str(files[theirs]), framework="pt") as f:
                    if list(f.get_slice(theirs).get_shape()) != list(full):
                        raise UserError(f"{files[theirs]}: {theirs} has shape {f.get_slice(theirs).get_shape()}, "
                                        f"config.json implies {list(full)}")
                    part = f.get_slice(theirs)[tuple(slice(a, b) for a, b in rows)]
            except UserError:
                raise
            except Exception as e:  # a damaged file: safetensors' own error types
                raise UserError(f"{files[theirs]}: not a readable safetensors file ({e})") from e
            index = tuple(slice(a, b) for a, b in rows)
            checkmtp_copies(name, part, cfg, lambda copy: _part(files, copy, index))
            p.zero_()
            p[tuple(slice(0, b - a) for a, b in rows)].copy_(part)


def load_hf(path: str | Path, **kw) -> Decoder:
    """Decoder(config_from_hf(path), **kw) with the checkpoint's weights (only the tensors the given
    layers / embedding / head need are read)."""
    cfg = config_from_hf(path)
    note = unread_note(path, cfg)
    if note:
        print(f"note: {note}")
    model = Decoder(cfg, **kw)
    state = state_dict_from_hf(path, cfg, names=model.state_dict().keys())
    model.load_state_dict(shard_state_dict(model, state))  # tensor-parallel: this rank's slices
    return model
