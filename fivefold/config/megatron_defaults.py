"""Megatron-LM's defaults, for what a Megatron command line leaves out.

A config in the Megatron dialect (any Megatron-LM flag in it) means what Megatron-LM would build:
a field no source set takes Megatron's default, not our canonical one. Megatron's GPT without
--swiglu / --normalization / --disable-bias-linear / --untie-embeddings-and-output-weights /
--position-embedding-type is GPT-2-like: GeLU MLP of 4h, LayerNorm, linear biases, tied
embeddings, learned absolute positions, dropout 0.1 on attention probabilities and hidden states;
its Adam has beta2 0.999 and its LR decays linearly (megatron/training/arguments.py); a --load folder
without a checkpoint starts the run from scratch (megatron/training/checkpointing.py); without
--calculate-per-token-loss its loss is the mean of per-microbatch means (megatron/core/pipeline_parallel/schedules.py).
Our canonical defaults (YAML, other dialects) stay as they are.

Five rules Megatron applies after parsing are applied here too: --swiglu without --ffn-hidden-size
gives int(8h/3 / 64) * 64 (rounded down, where our canonical default rounds up); learned absolute
positions without --max-position-embeddings (which Megatron requires) use seq_length;
--num-query-groups counts only with --group-query-attention (megatron/training/argument_utils.py:
without the switch the model has as many K/V heads as query heads); a MoE model's token dispatcher
is allgather unless --moe-token-dispatcher-type says otherwise; and --moe-router-pre-softmax
counts only with softmax scores (megatron/core/transformer/moe/moe_utils.py renormalises sigmoid and
sqrtsoftplus top-k weights whatever it says, where our field would keep them unnormalised).
"""
from __future__ import annotations

from fivefold.config.schema import Config

DEFAULTS: dict[str, object] = {
    "model.tie_word_embeddings": True,
    "model.normalization": "LayerNorm",
    "model.activation": "gelu",
    "model.add_bias_linear": True,
    "model.position_embedding_type": "learned_absolute",
    "model.attention_dropout": 0.1,
    "model.hidden_dropout": 0.1,
    "training.adam_beta2": 0.999,
    "training.lr_decay_style": "linear",
    "checkpoint.exit_on_missing_checkpoint": False,
    "training.calculate_per_token_loss": False,
}
"""Canonical field -> Megatron-LM's default, where it differs from ours."""
MOE_DEFAULTS: dict[str, object] = {"parallel.moe_token_dispatcher_type": "allgather"}
"""Megatron-LM's defaults that differ from ours only where they mean something: in a MoE model."""


def megatron_swiglu_ffn(hidden_size: int) -> int:
    """Megatron's --swiglu MLP width when --ffn-hidden-size is not given."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64


GQA_SWITCH = "--group-query-attention"
WHY = {"model.num_query_groups": f"{GQA_SWITCH} not given: Megatron-LM ignores --num-query-groups",
       "model.moe_router_pre_softmax": "Megatron-LM applies --moe-router-pre-softmax to softmax scores only, and "
                                       "renormalises sigmoid / sqrtsoftplus top-k weights"}
"""Why a field changed, where it is not simply "not given"."""


def apply_megatron_defaults(config: Config, explicit: set[str], switches: set[str] = frozenset()) -> list[str]:
    """Set every field of DEFAULTS (and of MOE_DEFAULTS in a MoE model) that no source set (not in
    `explicit`) to Megatron's value; then the derived widths and Megatron's GQA rule (`switches`: the
    fieldless flags given). Returns the dotted fields changed."""
    changed = []
    for dotted, value in {**DEFAULTS, **(MOE_DEFAULTS if config.model.num_experts else {})}.items():
        if dotted not in explicit:
            section, name = dotted.split(".")
            setattr(getattr(config, section), name, value)
            changed.append(dotted)
    m = config.model
    if m.activation == "swiglu" and "model.ffn_hidden_size" not in explicit:
        m.ffn_hidden_size = megatron_swiglu_ffn(m.hidden_size)
        changed.append("model.ffn_hidden_size")
    if m.position_embedding_type == "learned_absolute" and "model.max_position_embeddings" not in explicit:
        m.max_position_embeddings = config.training.seq_length
        changed.append("model.max_position_embeddings")
    if m.num_query_groups is not None and GQA_SWITCH not in switches:
        m.num_query_groups = None
        changed.append("model.num_query_groups")
    if m.moe_router_pre_softmax and m.moe_router_score_function != "softmax":
        m.moe_router_pre_softmax = False
        changed.append("model.moe_router_pre_softmax")
    return changed
