"""RLinf's and SkyRL's Megatron keys, each classified in one table (fivefold.config.keyed outcomes).

Both tools hand their keys to Megatron-Core under Megatron's own names, so a key whose name is a
TransformerConfig / OptimizerConfig / scheduler field is classified as Megatron-Bridge's field of that
name (fivefold.config.bridge); the tables here hold what each tool names or means differently.

RLinf (`actor.<section>.<key>`, surface: rlinf_surface.txt): `model` -> Bridge's model section,
`optim` -> optimizer, `lr_sched` -> scheduler (`max_lr` is the peak LR), `megatron` -> runtime keys.
Its values differ from Megatron's in spelling: `normalization: rmsnorm`, `precision: bf16`,
`activation: swiglu`.
SkyRL (`trainer.policy.megatron_config.<key>`, `trainer.megatron.<key>`, surface: skyrl_surface.txt):
MegatronConfig's fields, and its pass-through dicts `transformer_config_kwargs.<TransformerConfig
field>` and `optimizer_config_kwargs.<OptimizerConfig field>`.

fivefold's own field names under these prefixes (what `plan --emit rlinf|skyrl` writes) stay
accepted; a key that is neither the tool's nor ours is unknown, with the closest of the tool's keys.
SkyRL and RLinf build the model from the HF checkpoint, so no tool defaults are applied.
"""
from __future__ import annotations

from pathlib import Path

from fivefold.config import bridge
from fivefold.config.fields import SECTION_OF, did_you_mean
from fivefold.config.keyed import MAPPED, NOT_BUILT, NOTE, UNKNOWN, Taken, plain, truthy
from fivefold.config.megatron_surface import VALUE_OK, no_effect


def _read(name: str) -> dict[str, str]:
    lines = Path(__file__).with_name(name).read_text().splitlines()
    return {line.split(" ", 1)[0]: line.split(" ", 2)[2] for line in lines if not line.startswith("#")}


RLINF: dict[str, str] = _read("rlinf_surface.txt")
"""`section.key` -> the value most of RLinf's Megatron examples give."""
SKYRL: dict[str, str] = _read("skyrl_surface.txt")
"""MegatronConfig field (nested as `ddp_config.field`) -> its default."""

_NORMS = {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}
_PRECISIONS = {"bf16": "bf16", "bf16-mixed": "bf16", "16": "fp16", "fp16": "fp16", "16-mixed": "fp16",
               "32": "fp32", "fp32": "fp32", "32-true": "fp32"}


def _one_of(dotted: str, table: dict[str, str]):
    def convert(value):
        word = str(plain(value)).lower()
        if word not in table:
            return Taken(NOT_BUILT, why=f" ({value!r}; built: {', '.join(table)})")
        return Taken(MAPPED, [(dotted, table[word])])
    return convert


def _mapped(dotted: str):
    return lambda value: Taken(MAPPED, [(dotted, value)])


def _note(why: str):
    return lambda value: Taken(NOTE, why=why)


def _grouped_gemm(value) -> Taken:
    """RLinf's moe_grouped_gemm names its backend ('te' in its examples) or is a bool: any backend asks
    for the grouped experts."""
    v = plain(value)
    return Taken(MAPPED, [("model.moe_grouped_gemm", True if isinstance(v, str) and v else truthy(v))])


def _built_when_off(why: str):
    return lambda value: Taken(NOTE, why=f"off: {why}") if not truthy(value) else Taken(NOT_BUILT)


RLINF_KEYS = {
    "model.precision": _one_of("training.precision", _PRECISIONS),
    "model.normalization": _one_of("model.normalization", _NORMS | {"RMSNorm": "RMSNorm", "LayerNorm": "LayerNorm"}),
    "model.activation": _one_of("model.activation", {"swiglu": "swiglu", "gelu": "gelu"}),
    "model.encoder_seq_length": _note("RLinf sets it equal to seq_length"),
    "model.model_path": _note("the HF weights RLinf's rollout loads (fivefold's is checkpoint.load_hf)"),
    "model.model_type": _note("the HF architecture name RLinf converts from"),
    "model.megatron_checkpoint": lambda v: Taken(NOTE, why="none given") if plain(v) is None else Taken(
        NOT_BUILT, why=" (a Megatron checkpoint; fivefold loads its own or HF weights: checkpoint.load_hf)"),
    "model.is_lora": _built_when_off("LoRA"),
    "model.moe_grouped_gemm": _grouped_gemm,
    "model.moe_permute_fusion": _note("kernel fusion: the same math"),
    "model.use_cpu_initialization": _note("where weights are first built"),
    "optim.optimizer_enable_pin": _note("optimizer memory"),
    "lr_sched.max_lr": _mapped("training.lr"),
    "lr_sched.min_lr": _mapped("training.min_lr"),
    "megatron.mbridge": _note("how RLinf converts HF weights"),
    "megatron.use_hf_ckpt": _note("how RLinf converts HF weights"),
    "megatron.ckpt_convertor": _note("how RLinf converts HF weights"),
    "megatron.use_profiler": _note("profiling"), "megatron.profiler": _note("profiling"),
    "megatron.tp_comm_bootstrap_backend": _note("communication set-up"),
    "megatron.tp_comm_overlap_cfg": _note("communication overlap: the same sums"),
}
_RLINF_BRIDGE = {"model": "model", "optim": "optimizer", "lr_sched": "scheduler", "megatron": "dist"}

SKYRL_KEYS = {
    "moe_grouped_gemm": _mapped("model.moe_grouped_gemm"),
    "moe_per_layer_logging": _mapped("logging.moe_per_layer_logging"),
    "empty_cuda_cache": _note("CUDA memory housekeeping"),
    "dist_ckpt_optim_fully_reshardable": _note("checkpoint format: fivefold's loads in any layout"),
    "async_dist_ckpt_save": _mapped("checkpoint.async_save"),
    "async_dist_ckpt_strategy": _note("checkpoint I/O"), "async_save_prestage_to_cpu": _note("checkpoint I/O"),
    "mtp_loss_chunk_size": _note("memory: numerically identical (SkyRL's docstring)"),
    "hf_export_config.distributed_save": _note("checkpoint I/O"),
    "hf_export_config.save_every_n_ranks": _note("checkpoint I/O"),
    "ddp_config.grad_reduce_in_fp32": _mapped("training.accumulate_allreduce_grads_in_fp32"),
    "lora_config.merge_lora": _note("only with LoRA (lora_config.lora_type is not built)"),
}


def _megatron_named(bridge_key: str, value: object) -> Taken | None:
    """A key with Megatron's name: classified as Bridge's field of that name, or by Megatron's flag lists."""
    if bridge_key in bridge.SURFACE:
        return bridge.classify(bridge_key, value)
    name = bridge_key.split(".", 1)[1]
    if (mapped := bridge.megatron_flag(name)) is not None:
        return Taken(MAPPED, [(mapped.field, value)])
    flag = "--" + name.replace("_", "-")
    if flag in VALUE_OK and str(plain(value)) in VALUE_OK[flag][0]:
        return Taken(NOTE, why=VALUE_OK[flag][1])
    if (why := no_effect(flag)) is not None:
        return Taken(NOTE, why=why)
    return None


def _ours(name: str, value: object) -> Taken | None:
    return Taken(MAPPED, [(f"{SECTION_OF[name]}.{name}", value)]) if name in SECTION_OF else None


def classify_rlinf(key: str, value: object) -> Taken:
    """`section.key` under RLinf's `actor.` -> how it is taken."""
    section, _, name = key.partition(".")
    parent = f"{section}.{name.split('.')[0]}"
    if parent != key and parent in RLINF:  # a key inside a dict-valued key (megatron.profiler.output_dir)
        key, name = parent, name.split(".")[0]
    if key in RLINF_KEYS:
        return RLINF_KEYS[key](value)
    if section in _RLINF_BRIDGE and (t := _megatron_named(f"{_RLINF_BRIDGE[section]}.{name}", value)):
        if t.how != UNKNOWN:
            return t
    if section == "model" and (t := _ours(name, value)):
        return t
    if key in RLINF:
        return Taken(NOT_BUILT)
    return Taken(UNKNOWN, why=did_you_mean(key, [*RLINF, *(f"model.{n}" for n in SECTION_OF)]))


def classify_skyrl(key: str, value: object) -> Taken:
    """A key under SkyRL's `megatron_config.` -> how it is taken."""
    head, _, rest = key.partition(".")
    if head == "transformer_config_kwargs" and rest:
        return bridge.classify(f"model.{rest}", value)
    if head == "optimizer_config_kwargs" and rest:
        return bridge.classify(f"optimizer.{rest}", value)
    if SKYRL.get(head) == "-" and not rest and not plain(value):
        return Taken(NOTE, why="empty")
    if head == "model_config_kwargs":
        return Taken(NOT_BUILT, why=" (HF config overrides: give the model fields themselves)")
    if key in SKYRL_KEYS:
        return SKYRL_KEYS[key](value)
    if key in SKYRL:
        megatron_name = f"ddp.{rest}" if head == "ddp_config" else f"model.{key}"
        if (t := _megatron_named(megatron_name, value)) and t.how != UNKNOWN:
            return t
        default = SKYRL[key]
        if default != "-" and plain(value) == plain(default.strip("'")):
            return Taken(NOTE, why=f"SkyRL's default ({default}): nothing to build")
        return Taken(NOT_BUILT)
    return _ours(key, value) or Taken(UNKNOWN, why=did_you_mean(key, [*SKYRL, *SECTION_OF]))
