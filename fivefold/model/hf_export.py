"""Export a fivefold checkpoint (any layout) as a Hugging Face `save_pretrained` folder.

    export_hf(checkpoint, out_dir)   config.json, generation_config.json, model.safetensors (or
                                     model-0000k-of-0000n.safetensors + model.safetensors.index.json),
                                     and the run's tokenizer files when it used a Hugging Face tokenizer

Each parameter is assembled whole from the checkpoint's shards (every TP / PP / EP / ZeRO layout wrote
its slices at their offsets in the one-process tensor; `fivefold.checkpoint.io`), its padded vocabulary
rows dropped, renamed by `fivefold.model.hf.hf_name` (the importer's map, so import -> export gives the
same tensors, bit for bit) and written in the checkpoint's dtype, one tensor at a time: memory holds one
output shard (at most `max_shard_bytes`) and one parameter. A tied output layer is not written (HF ties
it to `model.embed_tokens.weight`).

Families: Llama (RMSNorm, SwiGLU, RoPE, no biases), Qwen2 (QKV biases), Qwen3 (q / k norms), Mixtral (its MoE layers: softmax router, top-k
renormalised, no shared expert, every layer MoE), Qwen3-MoE (Qwen3's q / k norms with Mixtral-like MoE
layers, top-k renormalised or not: norm_topk_prob), OLMoE (Qwen3-MoE's layers with q / k norms over the
whole projection: qk_layernorm_scope "projection") and DeepSeek-V3 (MLA; MoE layers with its router:
sigmoid, the expert bias written as e_score_correction_bias in fp32, groups, routed scaling, shared
experts, first layers dense; its multi-token prediction layers as layers num_hidden_layers + k - 1, with
the copies of the embedding and output layer DeepSeek-V3 stores in each) — the ones `load_hf` imports. Anything else is refused
naming what HF's config could not say.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fivefold.checkpoint.io import Held, _assemble, check_fits, read_metadata
from fivefold.checkpoint.layout import ShardSpec, source_name
from fivefold.checkpoint.metadata import damaged
from fivefold.config.schema import ModelConfig, config_from_dict
from fivefold.errors import NotImplementedYet, UserError, write_failed
from fivefold.model.hf import INDEX, SINGLE, _expected_shapes, mtp_copies, hf_name
from fivefold.model.init import VOCAB_PARAMS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt")
DTYPES = {"torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16}
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
    HF's DeepseekV3 routes one way only (fivefold.model.hf._deepseek_router): sigmoid scores plus
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


def _whole(folder: Path, meta: dict, name: str, cfg: ModelConfig, shape: tuple[int, ...]) -> torch.Tensor:
    """Parameter `name` of the one-process model, assembled from the checkpoint's shards, unpadded."""
    src = source_name(name, meta["params"])
    entry = meta["params"].get(src)
    if entry is None:
        raise UserError(f"checkpoint {folder}: no parameter {name} (was it saved by this model?)")
    padded = tuple(entry["global_shape"])
    out = torch.empty(padded, dtype=DTYPES.get(entry["dtype"], torch.float32))
    if not _assemble(folder, meta, entry, src, out, ShardSpec(padded, (0,) * len(padded))):
        raise UserError(f"checkpoint {folder}: its shards do not cover parameter {name} (a rank's files missing?)")
    return out[: shape[0]].contiguous() if name in VOCAB_PARAMS else out


def _size_bytes(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = text.strip().upper()
    for u in sorted(units, key=len, reverse=True):
        if t.endswith(u):
            try:
                size = float(t[: -len(u)])
            except ValueError:
                break
            if size >= 0 and math.isfinite(size):  # (0: a file per tensor, as transformers)
                return int(size * units[u])
            break
    if t.isdigit():
        return int(t)
    raise UserError(f"--max-shard-size {text!r}: give a size such as 5GB, 500MB or 2GiB")


def export_hf(checkpoint: str | Path, out_dir: str | Path, *, max_shard_size: str = "5GB") -> Path:
    """Write `checkpoint` (a step folder or a root with `latest`) as a save_pretrained folder, replacing
    an earlier export there (`check_replaceable`). The files are written into a new hidden folder
    beside OUT_DIR (`_new_folder`: never a name a user's folder has) and renamed into place once
    complete; an error or Ctrl-C removes it, and leaves OUT_DIR as it was."""
    out = check_replaceable(Path(out_dir))
    folder, meta = read_metadata(checkpoint, "CHECKPOINT")
    if "config" not in meta:
        raise UserError(f"checkpoint {folder}: its metadata has no config (not written by fivefold train)")
    try:
        config = config_from_dict(meta["config"])
    except TypeError as e:  # a key no section has (read_metadata checks the model section's)
        raise damaged(folder / "metadata.json", f"its config does not load ({e})") from None
    cfg = config.model
    shapes = _expected_shapes(cfg)
    names = [n for n in shapes if not (n == "head.weight" and cfg.tie_word_embeddings)]
    first = meta["params"].get(source_name(names[0], meta["params"]), {})
    dtype = DTYPES.get(first.get("dtype"), torch.float32)
    hf = hf_config(cfg, dtype)  # first: what HF cannot say (its shapes are not all `_expected_shapes`)
    # the same check as --load and convert: a config that does not describe the tensors is refused,
    # never exported as a folder transformers cannot load (or loads wrong)
    check_fits(meta, {n: Held(s, cfg.vocab_size if n in VOCAB_PARAMS else None) for n, s in shapes.items()},
               None, folder, fix="its metadata.json's config does not describe its tensors: the checkpoint is "
               "damaged (export the one before it)")
    limit = _size_bytes(max_shard_size)
    tmp = _new_folder(out, "export")
    try:
        _write_export(folder, meta, config, names, shapes, hf, limit, tmp)
        _replace(out, tmp)
    except OSError as e:  # a full disk, a read-only folder: named, OUT_DIR as it was
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failed(e.filename or tmp, e, f"the export; {out} is left as it was") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_export(folder: Path, meta: dict, config, names: list[str], shapes: dict, hf: dict, limit: int,
                  tmp: Path) -> None:
    cfg = config.model
    shards, current, size = [], {}, 0
    for name in names:
        t = _whole(folder, meta, name, cfg, shapes[name])
        copies = mtp_copies(cfg).get(name, [])  # DeepSeek-V3's MTP layers store their own (equal) copies
        if current and size + t.nbytes * (1 + len(copies)) > limit:
            shards.append(current)
            current, size = {}, 0
        current[hf_name(name, cfg)] = t
        current.update({copy: t.clone() for copy in copies})  # safetensors refuses tensors sharing storage
        size += t.nbytes * (1 + len(copies))
    shards.append(current)
    _write_shards(tmp, shards)
    (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps({"_from_model_config": True}, indent=2) + "\n")
    _copy_tokenizer(config.data.tokenizer, tmp)


def _new_folder(out: Path, what: str) -> Path:
    """A new, empty hidden folder beside `out`, named for what it holds (`.OUT.fivefold-export-3f9a1c`):
    made with mkdir, which fails rather than reuse a folder that exists, so no user's folder is ever
    written into or removed (as mkdtemp, but with the default permissions the final folder keeps)."""
    for _ in range(100):
        tmp = out.parent / f".{out.name}.fivefold-{what}-{os.urandom(3).hex()}"
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue
        except OSError as e:
            raise UserError(f"OUT_DIR {out}: cannot write beside it in {out.parent} ({e.strerror or e})") from None
    raise UserError(f"OUT_DIR {out}: cannot make a new folder in {out.parent}")


def _replace(out: Path, tmp: Path) -> None:
    """Move the complete `tmp` to `out`; an earlier export there (`check_replaceable`) is moved aside
    first and removed only once the new one is in place (a crash in between leaves it, hidden, beside)."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = _new_folder(out, "replaced")
    os.replace(out, old)  # (onto the empty folder just made: a rename of a folder over an empty one)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def check_replaceable(out: Path, flag: str = "OUT_DIR") -> Path:
    """`out`, resolved (`.` is the current folder), if it may be written: absent, empty, or an earlier
    export (`_an_export`), which the export replaces whole; a file, a folder holding anything else (a
    run, a checkpoint, a downloaded Hugging Face model, the user's files), the current folder or one
    above it, or a place that cannot be written is refused rather than deleted (`flag`: the option
    that named it; `fivefold train` checks checkpoint.save_hf before its ranks start)."""
    given, out = out, Path(out).resolve()
    cwd = Path.cwd().resolve()
    if out == cwd or out in cwd.parents:
        raise UserError(f"{flag} {given}: is the current folder{'' if out == cwd else ' or holds it'}, which the "
                        "export would replace whole; give a folder inside it, e.g. ./hf")
    if out.exists() and not out.is_dir():
        raise UserError(f"{flag} {given}: a file is there, not a folder (remove it, or give another path)")
    above = out.parent
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        raise UserError(f"{flag} {given}: {above} is a file, not a folder (give another path)")
    if not os.access(above, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {given}: {above} is not writable (give another path)")
    if not out.exists():
        return out
    names = {p.name for p in out.iterdir()}
    if names and not _an_export(out, names):
        shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
        raise UserError(f"{flag} {given}: holds {shown}, not an earlier export, and the export replaces the whole "
                        "folder; give a new or empty folder")
    return out


MARK = {"written_by": "fivefold export"}
"""In the weights' safetensors metadata (and the shard index's): the folder is an export, which a
later export may replace (`_an_export`); loaders read neither."""


def _an_export(folder: Path, names: set[str]) -> bool:
    """Whether `folder` (holding `names`) is what an export writes: only its files, and weights marked
    `MARK` (a Hugging Face model downloaded there has the same file names, not the mark)."""
    shards = {n for n in names if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", n)}
    if not names - shards <= {"config.json", "generation_config.json", SINGLE, INDEX, *TOKENIZER_FILES}:
        return False
    try:
        if SINGLE in names:
            with safe_open(str(folder / SINGLE), framework="pt") as f:
                meta = f.metadata() or {}
        else:
            meta = json.loads((folder / INDEX).read_text()).get("metadata", {})
    except (OSError, ValueError, AttributeError, SafetensorError):
        return False
    return isinstance(meta, dict) and all(meta.get(k) == v for k, v in MARK.items())


def _write_shards(folder: Path, shards: list[dict[str, torch.Tensor]]) -> None:
    if len(shards) == 1:
        save_file(shards[0], str(folder / SINGLE), metadata={"format": "pt", **MARK})
        return
    weight_map, total = {}, 0
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt", **MARK})
        weight_map.update({name: file for name in shard})
        total += sum(t.nbytes for t in shard.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total, **MARK}, "weight_map": weight_map},
                                           indent=2))


def _copy_tokenizer(tokenizer: str, folder: Path) -> None:
    """The run's Hugging Face tokenizer files (its data.tokenizer folder); nothing for the byte tokenizer."""
    src = Path(tokenizer)
    if tokenizer == "byte" or not src.is_dir():
        return
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, folder / name)
