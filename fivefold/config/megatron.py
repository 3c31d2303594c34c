"""Megatron-LM command-line flags (seed 001) -> canonical fields: one table, one parser.

Each flag takes one value, no value (a switch that stores a constant), or a list of values (until
the next `--flag`). `--flag=value` is accepted too. fivefold's own pipeline flags live in the same
table but do not make a command line "Megatron dialect" (they do not change Megatron's SP rules).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from fivefold.config.megatron_surface import SURFACE, VALUE_OK, no_effect
from fivefold.config.schema import cp_comm_name
from fivefold.errors import NotImplementedYet, UserError

VALUE, SWITCH, LIST = "value", "switch", "list"


@dataclass(frozen=True)
class Flag:
    field: str | None
    """Dotted canonical field, or None for a flag accepted and deliberately without effect."""
    kind: str = VALUE
    const: object = True
    """What a SWITCH stores."""
    ours: bool = False
    """fivefold's own flag (not Megatron-LM's)."""
    convert: Callable[[str], object] | None = None
    """Turns the flag's text into the field's value, where they differ."""


_PATTERN_TERM = re.compile(r"\[([01](?:,[01])*)\](?:\*(\d+))?")
"""One term of Megatron's --moe-layer-freq list expression: a list of 0 / 1, optionally repeated."""


def first_dense_layers(text: str) -> int:
    """--moe-layer-freq as the count of leading dense layers: 1 (every layer MoE), or a pattern of
    K zeros then ones, written as the Python list expression Megatron evaluates — "([0]*3+[1]*58)",
    "([0]+[1]*26)", "[0,0,0,1,1]" — sums of lists of 0 / 1, each optionally repeated. Other patterns
    (MoE every other layer, dense layers later) are not built."""
    t = text.strip().strip("'\"").replace(" ", "")
    while t.startswith("(") and t.endswith(")"):
        t = t[1:-1]
    if t == "1":
        return 0
    terms = t.split("+")
    if all(_PATTERN_TERM.fullmatch(term) for term in terms):
        bits = [int(b) for term in terms for b in _list_term(term)]
    else:
        raise NotImplementedYet(f"--moe-layer-freq {text}: only 1 or a pattern of dense layers first (e.g. "
                                "\"([0]*3+[1]*58)\") is built")
    k = bits.index(1) if 1 in bits else len(bits)
    if any(b == 0 for b in bits[k:]):
        raise NotImplementedYet(f"--moe-layer-freq {text}: dense layers after MoE layers; only the first layers "
                                "dense is built")
    return k


def _list_term(term: str) -> list[str]:
    body, times = _PATTERN_TERM.fullmatch(term).groups()
    return body.split(",") * int(times or 1)


def _v(field: str) -> Flag:
    return Flag(field)


def _on(field: str, const: object = True) -> Flag:
    return Flag(field, SWITCH, const)


FLAGS: dict[str, Flag] = {
    # parallel layout
    "--tensor-model-parallel-size": _v("parallel.tensor_model_parallel_size"),
    "--pipeline-model-parallel-size": _v("parallel.pipeline_model_parallel_size"),
    "--virtual-pipeline-model-parallel-size": _v("parallel.virtual_pipeline_model_parallel_size"),
    "--num-virtual-stages-per-pipeline-rank": _v("parallel.virtual_pipeline_model_parallel_size"),
    "--num-layers-per-virtual-pipeline-stage": _v("parallel.num_layers_per_virtual_pipeline_stage"),
    "--microbatch-group-size-per-virtual-pipeline-stage": _v("parallel.microbatch_group_size_per_vp_stage"),
    "--context-parallel-size": _v("parallel.context_parallel_size"),
    "--cp-comm-type": Flag("parallel.cp_comm_type", convert=cp_comm_name),
    "--hierarchical-context-parallel-sizes": Flag("parallel.hierarchical_context_parallel_sizes", LIST),
    "--expert-model-parallel-size": _v("parallel.expert_model_parallel_size"),
    "--expert-tensor-parallel-size": _v("parallel.expert_tensor_parallel_size"),
    "--sequence-parallel": _on("parallel.sequence_parallel"),
    "--overlap-moe-expert-parallel-comm": _on("parallel.overlap_moe_expert_parallel_comm"),
    "--tp-comm-overlap": _on("parallel.tp_comm_overlap"),
    "--moe-token-dispatcher-type": Flag("parallel.moe_token_dispatcher_type",
                                        convert=lambda v: "alltoall" if v == "alltoall_seq" else v),
    "--decoder-first-pipeline-num-layers": _v("parallel.decoder_first_pipeline_num_layers"),
    "--decoder-last-pipeline-num-layers": _v("parallel.decoder_last_pipeline_num_layers"),
    "--account-for-embedding-in-pipeline-split": _on("parallel.account_for_embedding_in_pipeline_split"),
    "--account-for-loss-in-pipeline-split": _on("parallel.account_for_loss_in_pipeline_split"),
    "--pipeline-schedule": Flag("parallel.pipeline_schedule", ours=True),
    "--pipeline-schedule-csv": Flag("parallel.pipeline_schedule_csv", ours=True),
    "--pipeline-layers-per-stage": Flag("parallel.pipeline_layers_per_stage", LIST, ours=True),
    "--pipeline-model-parallel-layout": _v("parallel.pipeline_model_parallel_layout"),
    # model
    "--num-layers": _v("model.num_layers"),
    "--hidden-size": _v("model.hidden_size"),
    "--ffn-hidden-size": _v("model.ffn_hidden_size"),
    "--num-attention-heads": _v("model.num_attention_heads"),
    "--group-query-attention": Flag(None, SWITCH),  # without it Megatron-LM ignores --num-query-groups
    "--num-query-groups": _v("model.num_query_groups"),
    "--kv-channels": _v("model.kv_channels"),
    "--vocab-size": _v("model.vocab_size"),
    "--make-vocab-size-divisible-by": _v("model.make_vocab_size_divisible_by"),
    "--max-position-embeddings": _v("model.max_position_embeddings"),
    "--normalization": _v("model.normalization"),
    "--norm-epsilon": _v("model.norm_epsilon"),
    "--rotary-base": _v("model.rotary_base"),
    "--untie-embeddings-and-output-weights": _on("model.tie_word_embeddings", False),
    "--init-method-std": _v("model.init_method_std"),
    "--add-qkv-bias": _on("model.add_qkv_bias"),
    "--swiglu": _on("model.activation", "swiglu"),
    "--disable-bias-linear": _on("model.add_bias_linear", False),
    "--position-embedding-type": _v("model.position_embedding_type"),
    "--use-rotary-position-embeddings": _on("model.position_embedding_type", "rope"),
    "--no-position-embedding": Flag(None, SWITCH),  # deprecated: ignored with rope, refused otherwise (load.py)
    "--apply-layernorm-1p": _on("model.apply_layernorm_1p"),
    "--attention-dropout": _v("model.attention_dropout"),
    "--hidden-dropout": _v("model.hidden_dropout"),
    "--qk-layernorm": _on("model.qk_layernorm"),
    "--multi-latent-attention": _on("model.multi_latent_attention"),
    "--q-lora-rank": _v("model.q_lora_rank"),
    "--kv-lora-rank": _v("model.kv_lora_rank"),
    "--qk-head-dim": _v("model.qk_head_dim"),
    "--qk-pos-emb-head-dim": _v("model.qk_pos_emb_head_dim"),
    "--v-head-dim": _v("model.v_head_dim"),
    "--num-experts": _v("model.num_experts"),
    "--moe-router-topk": _v("model.moe_router_topk"),
    "--moe-router-score-function": _v("model.moe_router_score_function"),
    "--moe-router-pre-softmax": _on("model.moe_router_pre_softmax"),
    "--moe-router-topk-scaling-factor": _v("model.moe_router_topk_scaling_factor"),
    "--moe-router-dtype": _v("model.moe_router_dtype"),
    "--moe-router-num-groups": _v("model.moe_router_num_groups"),
    "--moe-router-group-topk": _v("model.moe_router_group_topk"),
    "--moe-router-enable-expert-bias": _on("model.moe_router_enable_expert_bias"),
    "--moe-router-bias-update-rate": _v("model.moe_router_bias_update_rate"),
    "--moe-router-force-load-balancing": _on("model.moe_router_force_load_balancing"),
    "--moe-router-load-balancing-type": _v("model.moe_router_load_balancing_type"),
    "--moe-aux-loss-coeff": _v("model.moe_aux_loss_coeff"),
    "--moe-z-loss-coeff": _v("model.moe_z_loss_coeff"),
    "--moe-expert-capacity-factor": _v("model.moe_expert_capacity_factor"),
    "--moe-token-drop-policy": _v("model.moe_token_drop_policy"),
    "--moe-pad-expert-input-to-capacity": _on("model.moe_pad_expert_input_to_capacity"),
    "--moe-grouped-gemm": _on("model.moe_grouped_gemm"),
    "--moe-ffn-hidden-size": _v("model.moe_ffn_hidden_size"),
    "--moe-layer-freq": Flag("model.moe_first_k_dense_layers", convert=first_dense_layers),
    "--moe-shared-expert-intermediate-size": _v("model.moe_shared_expert_intermediate_size"),
    "--mtp-num-layers": _v("model.mtp_num_layers"),
    "--mtp-loss-scaling-factor": _v("model.mtp_loss_scaling_factor"),
    # training
    "--seq-length": _v("training.seq_length"),
    "--global-batch-size": _v("training.global_batch_size"),
    "--micro-batch-size": _v("training.micro_batch_size"),
    "--step-batch-size-schedule": _v("training.step_batch_size_schedule"),
    "--calculate-per-token-loss": _on("training.calculate_per_token_loss"),
    "--train-iters": _v("training.train_iters"),
    "--optimizer": Flag("training.optimizer", convert=lambda v: "adamw" if v == "adam" else v),  # Megatron's
    # adam decouples weight decay (--decoupled-weight-decay, on by default): AdamW
    "--lr": _v("training.lr"),
    "--min-lr": _v("training.min_lr"),
    "--lr-warmup-iters": _v("training.lr_warmup_iters"),
    "--lr-warmup-init": _v("training.lr_warmup_init"),
    "--exit-interval": _v("training.exit_interval"),
    "--manual-gc": _on("training.manual_gc"),
    "--manual-gc-interval": _v("training.manual_gc_interval"),
    "--no-manual-gc-eval": _on("training.manual_gc_eval", False),
    "--disable-manual-gc-eval": _on("training.manual_gc_eval", False),
    "--exit-duration-in-mins": _v("training.exit_duration_in_mins"),
    "--lr-warmup-samples": _v("training.lr_warmup_samples"),
    "--lr-warmup-fraction": _v("training.lr_warmup_fraction"),
    "--lr-decay-iters": _v("training.lr_decay_iters"),
    "--lr-decay-samples": _v("training.lr_decay_samples"),
    "--train-samples": _v("training.train_samples"),
    "--lr-decay-style": _v("training.lr_decay_style"),
    "--weight-decay": _v("training.weight_decay"),
    "--adam-beta1": _v("training.adam_beta1"),
    "--adam-beta2": _v("training.adam_beta2"),
    "--adam-eps": _v("training.adam_eps"),
    "--clip-grad": _v("training.clip_grad"),
    "--bf16": _on("training.precision", "bf16"),
    "--fp16": _on("training.precision", "fp16"),
    "--grad-reduce-in-bf16": _on("training.grad_reduce_in_bf16"),
    "--accumulate-allreduce-grads-in-fp32": _on("training.accumulate_allreduce_grads_in_fp32"),
    "--loss-scale": _v("training.loss_scale"),
    "--initial-loss-scale": _v("training.initial_loss_scale"),
    "--min-loss-scale": _v("training.min_loss_scale"),
    "--loss-scale-window": _v("training.loss_scale_window"),
    "--hysteresis": _v("training.hysteresis"),
    "--use-precision-aware-optimizer": _on("training.use_precision_aware_optimizer"),
    "--optimizer-cpu-offload": _on("training.optimizer_cpu_offload"),
    "--exp-avg-dtype": _v("training.exp_avg_dtype"),
    "--exp-avg-sq-dtype": _v("training.exp_avg_sq_dtype"),
    "--main-params-dtype": _v("training.main_params_dtype"),
    "--fp8-param-gather": _on("training.fp8_param_gather"),
    "--fp8-format": _v("training.fp8_format"),
    "--fp8-recipe": _v("training.fp8_recipe"),
    "--optimizer-offload-fraction": _v("training.optimizer_offload_fraction"),
    "--recompute-granularity": _v("training.recompute_granularity"),
    "--recompute-activations": _on("training.recompute_granularity", "selective"),  # Megatron's alias
    "--recompute-method": _v("training.recompute_method"),
    "--recompute-num-layers": _v("training.recompute_num_layers"),
    "--recompute-modules": Flag("training.recompute_modules", LIST),
    "--fine-grained-activation-offloading": _on("training.fine_grained_activation_offloading"),
    "--offload-modules": Flag("training.offload_modules", LIST),
    "--use-distributed-optimizer": _on("training.use_distributed_optimizer"),
    "--data-parallel-sharding-strategy": _v("training.data_parallel_sharding_strategy"),
    "--use-megatron-fsdp": _on("training.use_megatron_fsdp"),
    "--num-distributed-optimizer-instances": _v("training.num_distributed_optimizer_instances"),
    "--compile": Flag("training.compile", SWITCH, ours=True),
    "--seed": _v("training.seed"),
    "--eval-interval": _v("training.eval_interval"),
    "--eval-iters": _v("training.eval_iters"),
    "--check-for-nan-in-loss-and-grad": Flag("training.check_for_nan_in_loss_and_grad", SWITCH, ours=True),  # Megatron has only --no-
    "--no-check-for-nan-in-loss-and-grad": _on("training.check_for_nan_in_loss_and_grad", False),
    "--distributed-timeout-minutes": _v("training.distributed_timeout_minutes"),
    "--distributed-timeout-seconds": Flag("training.distributed_timeout_seconds", ours=True),
    # data, checkpoint, logging
    "--data-path": Flag("data.path", LIST),
    "--split": _v("data.split"),
    "--mock-data": _on("data.mock_data"),
    "--tokenizer-type": _v("data.tokenizer_type"),
    "--tokenizer-model": _v("data.tokenizer"),
    "--vocab-file": _v("data.vocab_file"),
    "--merge-file": _v("data.merge_file"),
    "--reset-position-ids": _on("data.reset_position_ids"),
    "--reset-attention-mask": _on("data.reset_attention_mask"),
    "--eod-mask-loss": _on("data.eod_mask_loss"),
    "--save": _v("checkpoint.save"),
    "--load": _v("checkpoint.load"),
    "--save-interval": _v("checkpoint.save_interval"),
    "--async-save": _on("checkpoint.async_save"),
    "--no-load-optim": _on("checkpoint.load_optim", False),
    "--finetune": _on("checkpoint.finetune"),
    "--exit-on-missing-checkpoint": _on("checkpoint.exit_on_missing_checkpoint"),
    "--no-load-rng": _on("checkpoint.load_rng", False),
    "--load-hf": Flag("checkpoint.load_hf", ours=True),
    "--save-hf": Flag("checkpoint.save_hf", ours=True),
    "--log-interval": _v("logging.log_interval"),
    "--tensorboard-dir": _v("logging.tensorboard_dir"),
    "--wandb-project": _v("logging.wandb_project"),
    "--wandb-exp-name": _v("logging.wandb_exp_name"),
    "--profile": _on("logging.profile"),
    "--moe-per-layer-logging": _on("logging.moe_per_layer_logging"),
    "--profile-ranks": Flag("logging.profile_ranks", LIST),
}


def flags_of(field: str) -> list[str]:
    """The flags that set `field`: Megatron-LM's (those of its pinned surface first, then older names
    the reader still takes), then fivefold's own; alphabetical within each."""
    return sorted((name for name, f in FLAGS.items() if f.field == field),
                  key=lambda name: (FLAGS[name].ours, name not in SURFACE, name))


def is_flag(word: str) -> bool:
    return word.startswith("--")


def parse_flags(words: list[str]) -> tuple[list[tuple[str, str | None, object]], bool, list[str]]:
    """Words of a Megatron-LM command line -> ([(flag, dotted field, raw value)], any Megatron flag?,
    [how each flag without effect here was taken]) — see fivefold.config.megatron_surface. A flag of
    the table that sets no field (--group-query-attention) comes with field None.

    Unknown flags and Megatron flags that are not built are all refused in one message (unknown ones
    each with the closest known flag; not-built ones as "not implemented yet").
    """
    out: list[tuple[str, str, object]] = []
    unknown: list[str] = []
    not_built: list[str] = []
    notes: list[str] = []
    megatron = False
    i = 0
    while i < len(words):
        word = words[i]
        if not is_flag(word):
            raise UserError(f"{word!r} follows no flag that takes a value")
        name, eq, inline = word.partition("=")
        flag = FLAGS.get(name)
        if flag is None:  # noted, with its values: the rest of the line is still read
            i += 1
            values = [inline] if eq else []
            while not eq and i < len(words) and not is_flag(words[i]) and SURFACE.get(name) != "switch":
                values.append(words[i])
                i += 1
                if SURFACE.get(name) == "value":
                    break
            _classify(name, values, unknown, not_built, notes)
            megatron |= name in SURFACE
            continue
        megatron |= not flag.ours
        i += 1
        if flag.kind == SWITCH:
            if eq:
                raise UserError(f"{name} is a switch and takes no value")
            value: object = flag.const
        elif eq:
            value = inline.split(",") if flag.kind == LIST else inline
        elif flag.kind == LIST:
            value = []
            while i < len(words) and not is_flag(words[i]):
                value.append(words[i])
                i += 1
            if not value:
                raise UserError(f"{name} needs at least one value")
        else:
            if i >= len(words) or is_flag(words[i]) and not _is_number(words[i]):
                raise UserError(f"{name} needs a value")
            value = words[i]
            i += 1
        try:
            out.append((name, flag.field, flag.convert(value) if flag.convert else value))
        except NotImplementedYet as e:  # a value not built: named with the others, not alone
            not_built.append(str(e).removesuffix(": not implemented yet"))
    not_built = list(dict.fromkeys(not_built))  # a flag given twice is named once
    built = f"Megatron-LM flag{'s' if len(not_built) > 1 else ''} {', '.join(not_built)} (they change what is trained)"
    if unknown:  # a typo first; what is not built comes along
        unknown_text = f"unknown flag{'s' if len(unknown) > 1 else ''} " + "; ".join(unknown)
        raise UserError(unknown_text + (f" | {built}: not implemented yet" if not_built else ""))
    if not_built:
        raise NotImplementedYet(built)
    return out, megatron, notes


def _classify(name: str, values: list[str], unknown: list[str], not_built: list[str], notes: list[str]) -> None:
    """A flag that maps to no field: no effect here (noted), not built, or not Megatron-LM's."""
    from fivefold.config.fields import ALIASES, TYPES, did_you_mean

    short = ALIASES.get(name[2:])
    if short and name not in SURFACE:  # --tp: fivefold's short name as a flag; the flag of its field
        flag = flags_of(short)[0]
        unknown.append(f"{name} (did you mean {flag}, or {name[2:]}={'true' if 'bool' in TYPES[short] else 'N'}?)")
    elif name in ("--dp", "--data-parallel-size"):
        unknown.append(f"{name} (data parallelism is what the world size leaves, world / (TP x CP x PP): "
                       "give the world size instead)")
    elif name not in SURFACE:
        unknown.append(f"{name}{did_you_mean(name, list(dict.fromkeys([*FLAGS, *SURFACE])))}")
    elif name in VALUE_OK:
        allowed, why = VALUE_OK[name]
        if all(v in allowed for v in values):
            notes.append(f"{name} {' '.join(values)}: {why}")
        else:
            not_built.append(f"{name} {' '.join(values)} (accepted: {', '.join(sorted(allowed))})")
    elif (why := no_effect(name)) is not None:
        notes.append(f"{name}: {why}")
    else:
        not_built.append(name)


def _is_number(word: str) -> bool:
    try:
        float(word)
        return True
    except ValueError:
        return False
