"""The chosen layout in each dialect the seeds use: our YAML, Megatron-LM flags, RLinf YAML, SkyRL
overrides, a torchrun command line. Each form loads back (`fivefold.config.load.load_config`) to
the same canonical config."""
from __future__ import annotations

import yaml

from fivefold.config.schema import Config, ModelConfig, to_dict

FORMATS = ("fivefold", "megatron", "rlinf", "skyrl", "torchrun")
_PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
             "context_parallel_size", "cp_comm_type", "expert_model_parallel_size", "expert_tensor_parallel_size",
             "sequence_parallel", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
             "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
_TRAINING = ("seq_length", "global_batch_size", "micro_batch_size", "recompute_granularity", "recompute_method",
             "recompute_num_layers", "use_distributed_optimizer")
_MODEL = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
          "vocab_size", "max_position_embeddings", "rotary_base", "norm_epsilon", "multi_latent_attention",
          "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "num_experts",
          "moe_router_topk", "moe_router_score_function", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size")


def _items(obj, names) -> list[tuple[str, object]]:
    default = type(obj)()
    out = []
    for n in names:
        v = getattr(obj, n)
        if v is not None and v != getattr(default, n):
            out.append((n, v))
    return out


def _model_items(m: ModelConfig) -> list[tuple[str, object]]:
    items = _items(m, _MODEL)
    if not m.multi_latent_attention:
        items = [(k, v) for k, v in items if k not in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")]
    return items


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def megatron_words(cfg: Config) -> list[str]:
    """Megatron-LM flags (booleans as switches; the model untied as our configs are)."""
    words = []
    for n, v in _items(cfg.parallel, _PARALLEL) + _items(cfg.training, _TRAINING) + _model_items(cfg.model):
        if v is True:
            words.append(_flag(n))
        elif v is not False:
            words += [_flag(n), str(v)]
    if not cfg.model.tie_word_embeddings:
        words.append("--untie-embeddings-and-output-weights")
    if cfg.training.precision in ("bf16", "fp16"):
        words.append(f"--{cfg.training.precision}")
    return words


def emit(cfg: Config, fmt: str, model_ref: str | None = None) -> str:
    """`cfg` as text in `fmt` (one of FORMATS)."""
    c = cfg.cluster
    if fmt == "fivefold":
        data = {"cluster": {"num_nodes": c.num_nodes, "gpus_per_node": c.gpus_per_node},
                "parallel": dict(_items(cfg.parallel, _PARALLEL)),
                "model": dict(_model_items(cfg.model)) | {"tie_word_embeddings": cfg.model.tie_word_embeddings},
                "training": dict(_items(cfg.training, _TRAINING)) | {"precision": cfg.training.precision}}
        head = f"# fivefold plan: {model_ref}\n" if model_ref else ""
        return head + yaml.safe_dump(data, sort_keys=False)
    if fmt == "megatron":
        return " \\\n  ".join(_pairs(megatron_words(cfg)))
    if fmt == "torchrun":
        launcher = f"torchrun --nproc_per_node={c.gpus_per_node} --nnodes={c.num_nodes} -m fivefold train"
        return launcher + " \\\n  " + " \\\n  ".join(_pairs(megatron_words(cfg)))
    if fmt == "rlinf":
        model = (dict(_items(cfg.parallel, _PARALLEL)) | dict(_items(cfg.training, _TRAINING))
                 | dict(_model_items(cfg.model)))
        data = {"cluster": {"num_nodes": c.num_nodes, "num_gpus_per_node": c.gpus_per_node},
                "actor": {"model": model}}
        return yaml.safe_dump(data, sort_keys=False)
    if fmt == "skyrl":
        pairs = _items(cfg.parallel, _PARALLEL) + _items(cfg.training, _TRAINING) + _model_items(cfg.model)
        return "\n".join(f"trainer.policy.megatron_config.{n}={_scalar(v)}" for n, v in pairs)
    raise ValueError(f"unknown format {fmt!r}; use one of {FORMATS}")


def _scalar(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def _pairs(words: list[str]) -> list[str]:
    """Group flags with their value for one flag per line."""
    out: list[str] = []
    for w in words:
        if w.startswith("--") or not out:
            out.append(w)
        else:
            out[-1] += " " + w
    return out


__all__ = ["FORMATS", "emit", "megatron_words", "to_dict"]
