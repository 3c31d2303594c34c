"""What the training runtime builds today: the ONE place that refuses the rest.

Every knob the config accepts but the runtime does not run yet is one row of `RUNTIME_KNOBS`: the
field, the test "this value runs", and what it is. Work that builds a dimension flips its row (or
deletes it). `check_supported` refuses all unsupported values at once with "not implemented yet",
before any rank starts.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fivefold.config.pipeline_layout import parse_layout
from fivefold.config.schema import Config
from fivefold.errors import NotImplementedYet

DECAY_STYLES = ("cosine", "linear", "constant")
"""Megatron-LM --lr-decay-style values the LR schedule runs (fivefold.train.schedule)."""

TOKENIZER_TYPES = (None, "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer")
"""Megatron-LM --tokenizer-type values built here (None: data.tokenizer says which; fivefold.data.tokenizer)."""


@dataclass(frozen=True)
class Knob:
    field: str
    """Dotted canonical field, e.g. parallel.tensor_model_parallel_size."""
    runs: Callable[[object], bool]
    """True for the values the runtime runs."""
    what: str


def _is(*ok):
    return lambda v: v in ok


RUNTIME_KNOBS: list[Knob] = [
    Knob("model.moe_router_load_balancing_type", _is("aux_loss", "seq_aux_loss", "none"),
         "sinkhorn load balancing (aux_loss, seq_aux_loss and none run)"),
    Knob("training.precision", _is("fp32", "bf16", "fp16"), "fp8 (the planner models it; the runtime trains fp32, bf16, fp16)"),
    Knob("training.optimizer", _is("adamw"), "optimizers other than adamw"),
    Knob("training.lr_decay_style", _is(*DECAY_STYLES), "LR decay styles other than cosine, linear and constant "
         "(Megatron's inverse-square-root and WSD)"),
    Knob("training.recompute_modules", lambda v: v is None or list(v) == ["core_attn"],
         "selective recompute of modules other than core_attn (the planner models Megatron's modules; the runtime "
         "recomputes the attention core)"),
    *(Knob(f"training.{name}", _is("fp32"), f"{name} other than fp32 (the planner counts it; the runtime keeps "
           "fp32 main parameters and AdamW moments)") for name in ("exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype")),
    Knob("training.fp8_param_gather", _is(False), "fp8 primary weights (the planner counts them; the runtime trains "
         "fp32, bf16, fp16)"),
    Knob("training.fine_grained_activation_offloading", _is(False),
         "fine-grained activation offloading (--offload-modules: the planner models it; the runtime keeps every "
         "activation on the device)"),
    Knob("parallel.pipeline_model_parallel_layout", lambda v: v is None or not any(parse_layout(v).mtp[:-1]),
         "an MTP layer (m) in another pipeline stage than the loss (L; the planner takes the string as Megatron runs "
         "it; the runtime runs MTP beside the loss: write every m in the last stage, e.g. `...|tmL`)"),
    Knob("data.tokenizer_type", _is(*TOKENIZER_TYPES),
         "Megatron tokenizer types other than HuggingFaceTokenizer, GPT2BPETokenizer and NullTokenizer (give "
         "--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR with a local tokenizer.json)"),

]


def _get(config: Config, dotted: str):
    section, name = dotted.split(".")
    return getattr(getattr(config, section), name)


def _combinations(config: Config) -> list[str]:
    """Values that run alone but not together."""
    p = config.parallel
    inside = [f"{name}={size}" for name, size in (("tensor_model_parallel_size", p.tensor_model_parallel_size),
                                                   ("context_parallel_size", p.context_parallel_size),
                                                   ("expert_model_parallel_size", p.expert_model_parallel_size))
              if size > 1]
    m = config.model
    if m.multi_latent_attention and m.add_qkv_bias:
        return ["add_qkv_bias with multi_latent_attention (it applies to grouped-query attention)"]
    if config.training.num_distributed_optimizer_instances > 1 and config.model.is_moe:
        return ["HSDP (num_distributed_optimizer_instances > 1) with MoE (dense models run it)"]
    m = config.model
    if m.is_moe and (m.activation != "swiglu" or m.add_bias_linear):
        return [f"model.activation={m.activation!r} with add_bias_linear={m.add_bias_linear} in a MoE model (experts "
                "are SwiGLU without biases: Megatron's --swiglu --disable-bias-linear run)"]
    if m.multi_latent_attention and (m.add_bias_linear or m.add_qkv_bias or m.position_embedding_type != "rope"):
        return [f"model.multi_latent_attention with add_bias_linear={m.add_bias_linear}, position_embedding_type="
                f"{m.position_embedding_type!r} (MLA is built with RoPE and without biases: Megatron's "
                "--disable-bias-linear --position-embedding-type rope)"]
    if m.attention_dropout and m.multi_latent_attention:
        return [f"model.attention_dropout={m.attention_dropout} with multi_latent_attention (attention dropout "
                "runs in GQA attention's explicit softmax path; hidden dropout runs everywhere; set "
                "attention_dropout=0)"]
    if m.mtp_num_layers and (config.data.reset_attention_mask or config.data.reset_position_ids):
        return [f"model.mtp_num_layers={m.mtp_num_layers} with packed documents (data.reset_attention_mask / "
                "reset_position_ids): MTP's roll of the tokens would cross documents (unpacked batches run)"]
    if config.training.compile and inside:
        return [f"training.compile=True with {', '.join(inside)} (compiled layers would trace the TP/CP/EP "
                "collectives inside them; DP, ZeRO and PP layouts compile)"]
    return []


def unsupported(config: Config) -> list[str]:
    """One line per knob set to a value the runtime does not run."""
    return ([f"{k.field}={_get(config, k.field)!r} ({k.what})" for k in RUNTIME_KNOBS if not k.runs(_get(config, k.field))]
            + _combinations(config))


def check_supported(config: Config) -> None:
    """Raise NotImplementedYet (CLI: exit 2, no traceback) naming every unsupported knob."""
    problems = unsupported(config)
    if problems:
        raise NotImplementedYet("training with " + "; ".join(problems) +
                                " — this runtime trains every parallel dimension (DP, TP, SP, CP, PP, EP, ETP, in any "
                                "combination), but not these knobs")
