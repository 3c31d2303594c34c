"""The flat sizes the validation rules read, and the `Rule` a broken one is.

`KNOB_FIELDS` names each knob's canonical field; `sizes_of(config)` flattens a Config into those knobs
(so the fix search can try many sizes without building Configs); dp_of, etp_of and ffn_of derive sizes
no field holds. The rules: rules.py (adjust, and the checks of every layout), rules_pipeline.py (the
pipeline's stages), rules_moe.py (experts and the router).
"""
from __future__ import annotations

from dataclasses import dataclass

from fivefold.config.schema import Config, default_ffn_size

KNOB_FIELDS = {
    "tp": "parallel.tensor_model_parallel_size", "pp": "parallel.pipeline_model_parallel_size",
    "vpp": "parallel.virtual_pipeline_model_parallel_size", "cp": "parallel.context_parallel_size",
    "ep": "parallel.expert_model_parallel_size", "etp": "parallel.expert_tensor_parallel_size",
    "sp": "parallel.sequence_parallel", "hcp": "parallel.hierarchical_context_parallel_sizes",
    "a2a_overlap": "parallel.overlap_moe_expert_parallel_comm", "tp_overlap": "parallel.tp_comm_overlap",
    "dispatcher": "parallel.moe_token_dispatcher_type",
    "cp_comm": "parallel.cp_comm_type", "schedule": "parallel.pipeline_schedule",
    "order": "parallel.order", "split": "parallel.pipeline_layers_per_stage",
    "first": "parallel.decoder_first_pipeline_num_layers",
    "last": "parallel.decoder_last_pipeline_num_layers",
    "acc_emb": "parallel.account_for_embedding_in_pipeline_split",
    "acc_loss": "parallel.account_for_loss_in_pipeline_split",
    "vpp_layers": "parallel.num_layers_per_virtual_pipeline_stage",
    "pp_layout": "parallel.pipeline_model_parallel_layout",
    "group": "parallel.microbatch_group_size_per_vp_stage",
    "layers": "model.num_layers", "heads": "model.num_attention_heads", "kv": "model.num_query_groups",
    "hidden": "model.hidden_size", "ffn": "model.ffn_hidden_size", "kvc": "model.kv_channels",
    "vocab": "model.vocab_size", "vocab_div": "model.make_vocab_size_divisible_by",
    "moe_ffn": "model.moe_ffn_hidden_size", "shared": "model.moe_shared_expert_intermediate_size",
    "mla": "model.multi_latent_attention", "norm": "model.normalization",
    "experts": "model.num_experts", "topk": "model.moe_router_topk",
    "capacity": "model.moe_expert_capacity_factor", "drop": "model.moe_token_drop_policy",
    "pad": "model.moe_pad_expert_input_to_capacity",
    "seq": "training.seq_length", "gbs": "training.global_batch_size", "mbs": "training.micro_batch_size",
    "rgran": "training.recompute_granularity", "rmethod": "training.recompute_method",
    "rnum": "training.recompute_num_layers", "world": "cluster.world_size",
    "log": "logging.log_interval",
    "act": "model.activation", "pos": "model.position_embedding_type", "maxpos": "model.max_position_embeddings",
    "qk_scope": "model.qk_layernorm_scope",
    "score": "model.moe_router_score_function", "rdtype": "model.moe_router_dtype",
    "groups": "model.moe_router_num_groups", "gtopk": "model.moe_router_group_topk",
    "ebias": "model.moe_router_enable_expert_bias", "brate": "model.moe_router_bias_update_rate",
    "rscale": "model.moe_router_topk_scaling_factor", "mtp": "model.mtp_num_layers",
    "precision": "training.precision",
}


@dataclass(frozen=True)
class Rule:
    field: str
    value: object
    rule: str
    knobs: tuple[str, ...]
    """Knobs that can fix it, preferred first."""
    severity: str = "error"


_KNOB_PATHS = tuple((knob, *dotted.split(".")) for knob, dotted in KNOB_FIELDS.items())
_KNOB_SECTIONS = tuple({section for _, section, _ in _KNOB_PATHS})


def sizes_of(config: Config) -> dict:
    sections = {name: vars(getattr(config, name)) for name in _KNOB_SECTIONS}
    s = {knob: sections[section][name] for knob, section, name in _KNOB_PATHS}  # every knob is a field
    c = config.cluster
    s["world"] = c.resolved_world_size
    s["gpn"] = c.gpus_per_node
    for k in ("hcp", "split"):
        s[k] = tuple(s[k]) if s[k] is not None else None
    return s


def dp_of(s: dict) -> int:
    return s["world"] // (s["tp"] * s["pp"] * s["cp"])


def etp_of(s: dict) -> int:
    return s["etp"] if s["etp"] is not None else s["tp"]


def ffn_of(s: dict) -> int:
    if s["ffn"]:
        return s["ffn"]
    return 4 * s["hidden"] if s["act"] == "gelu" else default_ffn_size(s["hidden"])
