"""Every Megatron-Bridge config field, classified: how a Bridge config or override is taken here.

The surface (`bridge_surface.txt`: ConfigContainer's sections on the GPT path at a pinned commit,
written by scripts/bridge_surface.py) says each field's kind and Bridge's default. A key is
`cfg.<section>.<field>` (Bridge's Python recipes, seed 002), or `<section>.<field>` (its OmegaConf
overrides and YAML: `train.global_batch_size=16`, `optimizer.lr=3e-4`). Two Bridge sections share a
name with ours, `model` and `checkpoint`: there a field fivefold has (`model.num_layers`,
`checkpoint.save`) is ours, any other (`model.num_moe_experts`) is Bridge's; `cfg.` always means
Bridge's. One table classifies every field (fivefold.config.keyed):

  mapped     RENAMES (TransformerConfig's own names, values that mean something else here), then
             a field whose name is a Megatron-LM flag's (`--` + name with dashes) in
             fivefold.config.megatron.FLAGS, then a canonical field of the same name;
  no effect  HOUSEKEEPING sections (logging extras, profiling, fault tolerance, ...), Megatron-named
             fields megatron_surface.no_effect accepts, NOTES, and any field given at Bridge's own
             default (it builds nothing either way);
  not built  the other fields of the surface, refused all at once;
  unknown    not in the surface: did-you-mean over it.

Where a config is all Bridge keys, what it leaves out is Bridge's default (GPTModelProvider /
TransformerConfig: LayerNorm, GeLU MLP of 4h, biases, dropout 0.1, tied embeddings, learned absolute
positions; OptimizerConfig's Adam beta2 0.999, weight decay 0.01; linear LR decay): `apply_defaults`.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

from fivefold.config.fields import SECTION_OF, TYPES, coerce, did_you_mean
from fivefold.config.keyed import MAPPED, NOT_BUILT, NOTE, UNKNOWN, Taken, plain, truthy
from fivefold.config.megatron import FLAGS, SWITCH, first_dense_layers
from fivefold.config.megatron_surface import VALUE_OK, no_effect
from fivefold.config.schema import cp_comm_name
from fivefold.errors import NotImplementedYet

SURFACE_FILE = Path(__file__).with_name("bridge_surface.txt")
_MISSING = object()


def _read_surface() -> dict[str, tuple[str, object]]:
    out = {}
    for line in SURFACE_FILE.read_text().splitlines():
        if not line.startswith("#"):
            key, kind, default = line.split(" ", 2)
            out[key] = (kind, _MISSING if default == "-" else ast.literal_eval(default))
    return out


SURFACE: dict[str, tuple[str, object]] = _read_surface()
"""`section.field` -> (bool / value / list, Bridge's default or _MISSING where not a literal)."""
SECTIONS = sorted({k.split(".")[0] for k in SURFACE})
OURS = ("model", "parallel", "training", "data", "checkpoint", "logging", "cluster")


def _when_true(dotted: str, value: object):
    """A Bridge switch that sets `dotted` to `value` when True and leaves it to other keys otherwise."""
    def convert(switch):
        return [(dotted, value)] if truthy(switch) else []
    return convert


def _precision(word: str):
    return _when_true("training.precision", word)


_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "half": "fp16", "fp16": "fp16",
           "float32": "fp32", "float": "fp32", "fp32": "fp32"}

_STATE_DTYPES = {**_DTYPES, "uint8": "fp8", "fp8": "fp8"}
"""OptimizerConfig's exp_avg_dtype / exp_avg_sq_dtype / main_params_dtype are torch dtypes (Megatron-LM
maps --exp-avg-dtype fp8 to torch.uint8): our names for them."""


def _dtype_word(value) -> str:
    return str(plain(value)).removeprefix("torch.")


def _dtype(value):
    word = _dtype_word(value)
    if word not in _DTYPES:
        raise NotImplementedYet(f"params_dtype {value!r} (built: {', '.join(sorted(set(_DTYPES)))})")
    return [("training.precision", _DTYPES[word])]


RECIPES = {"bf16_mixed": "bf16", "fp16_mixed": "fp16", "32-true": "fp32", "fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}
"""Megatron-Bridge's mixed-precision recipe names (training/mixed_precision.py) that are built here."""


FP8_RECIPE_NAMES = {f"{p}_with_{name}_mixed": scaling for p in ("bf16", "fp16") for name, scaling in (
    ("fp8_delayed_scaling", "delayed"), ("fp8_current_scaling", "tensorwise"), ("fp8_subchannel_scaling", "blockwise"),
    ("mxfp8", "mxfp8"))}
"""Bridge's fp8 recipe names (training/mixed_precision.py: fp8="hybrid" and their fp8_recipe), read for
the planner: 16-bit parameters, fp8 GEMMs (`train` refuses fp8)."""


def recipe(value):
    """`mixed_precision: bf16_mixed` (a recipe name): the precision (fp8 and its scaling for Bridge's fp8
    recipes); fp4 recipes are not built."""
    word = str(plain(value))
    if word in FP8_RECIPE_NAMES:
        return [("training.precision", "fp8"), ("training.fp8_format", "hybrid"),
                ("training.fp8_recipe", FP8_RECIPE_NAMES[word])]
    if word not in RECIPES:
        raise NotImplementedYet(f"mixed_precision={word} (built recipes: {', '.join([*RECIPES, *FP8_RECIPE_NAMES])})")
    return [("training.precision", RECIPES[word])]


def classify_recipe(value) -> Taken:
    """The whole mixed_precision section given as one of Bridge's recipe names."""
    try:
        return Taken(MAPPED, recipe(value))
    except NotImplementedYet as e:
        return Taken(NOT_BUILT, why=f" ({str(e).removesuffix(': not implemented yet')})")


def _to(dotted: str, convert=None):
    return lambda value: [(dotted, convert(value) if convert else value)]


def _truthy_int(value):
    """A bool field that Bridge's recipes set to a number (train.manual_gc_eval = 100): Python's truth
    of the number; any other value as given."""
    return str(value).strip() != "0" if str(value).strip().isdigit() else value


def _state_dtype(dotted: str):
    """A torch dtype of the optimizer's state as our name; another word is kept for validation to refuse
    with the choices."""
    return _to(dotted, lambda value: _STATE_DTYPES.get(_dtype_word(value), _dtype_word(value)))


_fp8_param = _when_true("training.fp8_param_gather", True)
"""TransformerConfig's fp8_param is Megatron-LM's --fp8-param-gather (Bridge's mixed_precision syncs the two):
True sets it; False and None (Bridge's "as fp8_param_gather") leave it to fp8_param_gather."""


RENAMES = {  # Bridge field -> [(canonical field, value)]
    "model.num_moe_experts": _to("model.num_experts"),
    "model.share_embeddings_and_output_weights": _to("model.tie_word_embeddings"),
    "model.layernorm_epsilon": _to("model.norm_epsilon"),
    "model.layernorm_zero_centered_gamma": _to("model.apply_layernorm_1p"),
    # TransformerConfig's activation_func is a callable (F.gelu; recipes with a GLU set F.silu):
    # the gate switch says which MLP is built
    "model.gated_linear_unit": lambda v: [("model.activation", "swiglu" if truthy(v) else "gelu")],
    "model.seq_length": _to("training.seq_length"),
    "model.microbatch_group_size_per_vp_stage": _to("parallel.microbatch_group_size_per_vp_stage"),
    "model.cp_comm_type": _to("parallel.cp_comm_type", lambda v: cp_comm_name(plain(v))),
    "model.moe_layer_freq": _to("model.moe_first_k_dense_layers", lambda v: first_dense_layers(str(v))),
    "model.bf16": _precision("bf16"), "model.fp16": _precision("fp16"),
    "optimizer.bf16": _precision("bf16"), "optimizer.fp16": _precision("fp16"),
    "mixed_precision.bf16": _precision("bf16"), "mixed_precision.fp16": _precision("fp16"),
    "model.params_dtype": _dtype, "optimizer.params_dtype": _dtype,
    "optimizer.exp_avg_dtype": _state_dtype("training.exp_avg_dtype"),
    "optimizer.exp_avg_sq_dtype": _state_dtype("training.exp_avg_sq_dtype"),
    "optimizer.main_params_dtype": _state_dtype("training.main_params_dtype"),
    "model.fp8_param": _fp8_param, "mixed_precision.fp8_param": _fp8_param,
    "model.fp8": _to("training.fp8_format"), "mixed_precision.fp8": _to("training.fp8_format"),
    "model.fp8_recipe": _to("training.fp8_recipe"), "mixed_precision.fp8_recipe": _to("training.fp8_recipe"),
    "ddp.grad_reduce_in_fp32": _to("training.accumulate_allreduce_grads_in_fp32"),
    "mixed_precision.grad_reduce_in_fp32": _to("training.accumulate_allreduce_grads_in_fp32"),
    "dataset.data_path": _to("data.path"),
    "dataset.blend": lambda v: [("data.path", _blend(v))],
    "dataset.seq_length": _to("training.seq_length"),
    "dataset.sequence_length": _to("training.seq_length"),
    "tokenizer.tokenizer_model": _to("data.tokenizer"),
    "tokenizer.vocab_size": _to("model.vocab_size"),
    "tokenizer.make_vocab_size_divisible_by": _to("model.make_vocab_size_divisible_by"),
    "rng.seed": _to("training.seed"),
    # Megatron's weight-decay schedule: constant (the only one built) needs start == end, its weight decay
    "scheduler.start_weight_decay": _to("training.weight_decay"),
    "scheduler.end_weight_decay": _to("training.weight_decay"),
    "train.eval_interval": _to("training.eval_interval"), "train.eval_iters": _to("training.eval_iters"),
    "train.manual_gc": _to("training.manual_gc"), "train.manual_gc_interval": _to("training.manual_gc_interval"),
    "train.manual_gc_eval": _to("training.manual_gc_eval", _truthy_int),
    "profiling.use_pytorch_profiler": _to("logging.profile"),
    "profiling.profile_ranks": _to("logging.profile_ranks"),
}


def _blend(value) -> str:
    """dataset.blend, Bridge's ([prefixes], [weights] or None), as Megatron's weighted --data-path words."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], (list, tuple)):
        paths, weights = value
        return " ".join(f"{w} {p}" for w, p in zip(weights, paths)) if weights else " ".join(paths)
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


HOUSEKEEPING = {
    "logger": "logging (fivefold writes metrics.jsonl, TensorBoard and W&B from logging.*)",
    "profiling": "profiling (profiling.use_pytorch_profiler and profile_ranks are mapped)",
    "ft": "fault tolerance: a job-restart service", "straggler": "straggler detection",
    "nvrx_straggler": "straggler detection", "inprocess_restart": "in-process restart",
    "rerun_state_machine": "result-checking reruns", "tensor_inspect": "tensor inspection (debugging)",
    "comm_overlap": "communication overlap: a schedule choice, the same sums",
    "dist": "process-group set-up (gloo / NCCL are chosen by device)",
}
"""Bridge sections whose fields change no math here (fields mapped by name still are, e.g. tensorboard_dir)."""

NOTES = {
    "tokenizer.tensor_model_parallel_size": "Bridge copies it from model.tensor_model_parallel_size",
    "tokenizer.rank": "set by Bridge at run time",
    "dataset.context_parallel_size": "Bridge copies it from the model", "dataset.data_parallel_size":
    "Bridge derives it from the world size", "dataset.sequence_parallel_size": "Bridge copies it from the model",
    "dataset.random_seed": "fivefold orders data from training.seed (rng.seed)",
    "dataset.num_workers": "data-loader workers", "dataset.pin_memory": "data-loader memory",
    "dataset.persistent_workers": "data-loader workers", "dataset.path_to_cache": "index cache location",
    "dataset.mmap_bin_files": "how .bin files are read",
    "checkpoint.ckpt_format": "checkpoint format: fivefold writes its own (any layout loads any other)",
    "dataset.tokenizer": "Bridge sets it from the tokenizer section",
    "model.activation_func": "the MLP is chosen by gated_linear_unit (False: GeLU, True: SwiGLU)",
}


RUNTIME = [(re.compile(pattern), why) for pattern, why in [
    (r"model\.(batch_p2p_(comm|sync)|deallocate_pipeline_outputs|cpu_offloading.*|fine_grained_(activation_)?offload.*|"
     r"offload_modules|min_offloaded_tensor_size|activation_offload_fraction|delta_offload_bytes_across_pp_ranks|"
     r"persist_layer_norm|memory_efficient_layer_norm|timers|config_logger_dir|barrier_with_L1_time|"
     r"variable_seq_lengths|perform_initialization|parallel_output|use_te_rng_tracker|pipeline_dtype|"
     r"(finalize_model_grads|grad_scale|no_sync|param_sync|grad_sync|moe_grad_scale|mtp_grad_scale)_func|"
     r"init_model_with_meta_device|disable_parameter_transpose_cache|hf_model_(id|revision)|transformer_layer_spec|"
     r"use_transformer_engine_(full_layer_spec|op_fuser)|clone_scatter_output_in_embedding|use_ring_exchange_p2p|"
     r"pipeline_model_parallel_comm_backend|high_priority_a2a_comm_stream|ep_overlap_early_attn_memory_release|"
     r"symmetric_ar_type|moe_deepep_num_sms|moe_hybridep_.*|moe_enable_deepep|moe_ncclep_zero_copy|moe_paged_stash.*|"
     r"moe_use_grouped_tensor|dense_grouped_gemm|fused_.*|use_te_activation_func|use_kitchen.*|kitchen_attention_backend|"
     r"inference_.*|flash_decode|mlp_chunks_for_prefill|nccl_all_reduce_for_prefill|use_inference_optimized_layers|"
     r"should_pad_vocab|test_mode|restore_modelopt_state|distribute_saved_activations|"
     r"wgrad_deferral_limit|use_mamba_mem_eff_path|attention_softmax_in_fp32)",
     "a runtime, memory or kernel choice of Megatron-Core's (fivefold runs its own, with the same math)"),
    (r"optimizer\.(pin_cpu_grads|pin_cpu_params|timers|config_logger_dir|barrier_with_L1_time|"
     r"use_torch_optimizer_for_cpu_offload|store_param_remainders)", "optimizer memory or logging"),
    (r"ddp\.(bucket_size|num_buckets|pad_buckets_for_high_nccl_busbw|average_in_collective|nccl_ub|"
     r"disable_symmetric_registration|fsdp_.*|megatron_fsdp_(cuda_graph_mode|enable_fine_grained_param_gather|"
     r"max_pool_double_buffer|version)|keep_fp8_transpose_cache|suggested_communication_unit_size|"
     r"check_for_nan_in_grad|check_for_large_grads)", "gradient buckets and communication buffers: the same sums"),
    (r"checkpoint\.(async_strategy|async_write_results_mp_mode|fully_parallel_.*|storage_writers_per_rank|"
     r"replication.*|verify_integrity|most_recent_k|save_retain_interval|save_optim|save_rng|save_tokenizer_assets|"
     r"custom_manager_class|distrib_optim_fully_reshardable_mem_efficient|strict_fsdp_dtensor_load|"
     r"also_save_hf_checkpoint|hf_distributed_save|hf_save_every_n_ranks|"
     r"save_(activations|dgrads|wgrads|params|tokens_per_expert)_interval)",
     "checkpoint format and I/O: fivefold writes its own safetensors checkpoints with optimizer and RNG state"),
    (r"dataset\.(num_dataset_builder_threads|fast_cache_load|defer_npy_index_mmap|object_storage_cache_path|"
     r"data_sharding|dataloader_.*|create_attention_mask)", "data loading"),
    (r"train\.(check_optimizer_step_success|gpu_sniff_test_interval|train_sync_interval)|rng\.(te|inference)_rng_tracker|"
     r"validation\.eval_micro_batch_size", "runtime checks and housekeeping"),
]]
"""Bridge-named fields (Megatron-LM spells them otherwise or not at all) that change no math here."""


def megatron_flag(name: str):
    flag = FLAGS.get("--" + name.replace("_", "-"))
    if flag is None or flag.field is None or flag.ours:
        return None
    if flag.kind == SWITCH and flag.const is not True:  # --swiglu stores "swiglu": not a field's bool
        return None
    return flag


def classify(key: str, value: object) -> Taken:
    """A Bridge `section.field` (no `cfg.`) and its value -> how it is taken here."""
    if key not in SURFACE:
        return Taken(UNKNOWN, why=did_you_mean(key, SURFACE))
    section, name = key.split(".", 1)
    if key in RENAMES:
        try:
            return Taken(MAPPED, RENAMES[key](value))
        except NotImplementedYet as e:
            return Taken(NOT_BUILT, why=f" ({str(e).removesuffix(': not implemented yet')})")
    if key not in NOTES:
        if (flag := megatron_flag(name)) is not None:
            if flag.kind == SWITCH and plain(value) is None:  # comm_overlap's None: the model's setting stands
                return Taken(NOTE, why="None: Bridge keeps the model's setting")
            return Taken(MAPPED, [(flag.field, flag.convert(str(value)) if flag.convert else value)])
        if name in SECTION_OF and (section not in ("tokenizer", "dataset") or SECTION_OF[name] == "data"):
            return Taken(MAPPED, [(f"{SECTION_OF[name]}.{name}", value)])
    flag_name = "--" + name.replace("_", "-")
    if flag_name in VALUE_OK:
        allowed, why = VALUE_OK[flag_name]
        if str(plain(value)) in allowed:
            return Taken(NOTE, why=why)
    why = HOUSEKEEPING.get(section) or NOTES.get(key) or no_effect(flag_name) or next(
        (why for pattern, why in RUNTIME if pattern.fullmatch(key)), None)
    if why:
        return Taken(NOTE, why=why)
    if _at_default(key, value):
        return Taken(NOTE, why=f"Bridge's default ({value!r}): nothing to build")
    return Taken(NOT_BUILT)


def _at_default(key: str, value: object) -> bool:
    default = SURFACE[key][1]
    v = plain(value)
    if default is _MISSING:
        return v is None
    if isinstance(default, tuple):
        default = list(default)
    return v == default or (v in (None, [], {}) and default in (None, False, [], 0))


SECTION_KEYS = re.compile(r"cfg\.(\w+)\.(.+)")


def bridge_key(key: str) -> str | None:
    """The Bridge `section.field` a dotted key names, or None where the key is not Bridge's.

    `cfg.s.f` always; `s.f` for Bridge sections not named like ours; `model.f` / `checkpoint.f` only
    where fivefold's section has no field f."""
    if key.startswith("cfg."):
        return key[4:]
    section, _, name = key.partition(".")
    if not name or section not in SECTIONS:
        return None
    if section in OURS:
        return key if f"{section}.{name}" not in TYPES and key in SURFACE else None
    return key


DEFAULTS = ("model.add_bias_linear", "model.gated_linear_unit", "model.normalization", "model.hidden_dropout",
            "model.attention_dropout", "model.share_embeddings_and_output_weights", "model.position_embedding_type",
            "model.layernorm_epsilon", "model.layernorm_zero_centered_gamma", "model.add_qkv_bias",
            "model.qk_layernorm", "model.rotary_base", "model.init_method_std", "model.make_vocab_size_divisible_by",
            "model.seq_length", "optimizer.adam_beta1", "optimizer.adam_beta2", "optimizer.adam_eps",
            "optimizer.weight_decay", "optimizer.clip_grad", "scheduler.lr_decay_style", "scheduler.lr_warmup_iters",
            "scheduler.lr_warmup_init", "rng.seed", "checkpoint.exit_on_missing_checkpoint", "model.calculate_per_token_loss")
"""Bridge fields whose default (read from the pinned surface) a Bridge config means when it leaves them out."""


def apply_defaults(config, explicit: set[str]) -> list[str]:
    """Set each canonical field of DEFAULTS that no source set to Bridge's value, and for a MoE model its
    token dispatcher, then Bridge's derived sizes (TransformerConfig: ffn_hidden_size = 4h, with or
    without a GLU; learned absolute positions up to seq_length). Returns the dotted fields changed."""
    changed = []
    for key in DEFAULTS:
        for dotted, value in classify(key, SURFACE[key][1]).pairs:
            if dotted not in explicit:
                _set(config, dotted, coerce(dotted, value), changed)
    m = config.model
    if m.num_experts and "parallel.moe_token_dispatcher_type" not in explicit:
        _set(config, "parallel.moe_token_dispatcher_type", SURFACE["model.moe_token_dispatcher_type"][1], changed)
    if "model.ffn_hidden_size" not in explicit:
        _set(config, "model.ffn_hidden_size", 4 * m.hidden_size, changed)
    if m.position_embedding_type == "learned_absolute" and "model.max_position_embeddings" not in explicit:
        _set(config, "model.max_position_embeddings", config.training.seq_length, changed)
    return changed


def _set(config, dotted: str, value: object, changed: list[str]) -> None:
    section, name = dotted.split(".")
    if getattr(getattr(config, section), name) != value:
        setattr(getattr(config, section), name, value)
        changed.append(dotted)
