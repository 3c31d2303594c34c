"""The chosen layout in each dialect the seeds use: our YAML, Megatron-LM flags, RLinf YAML, SkyRL
overrides, a torchrun command line. Each form loads back (`fivefold.config.load.load_config`) to
the same canonical config."""
from __future__ import annotations

import shlex
from dataclasses import fields

import yaml

from fivefold.config.dialects import SKYRL_CLUSTER
from fivefold.config.megatron import FLAGS, LIST, VALUE, flags_of
from fivefold.config.megatron_defaults import DEFAULTS, GQA_SWITCH, MOE_DEFAULTS
from fivefold.errors import UserError
from fivefold.config.schema import Config, to_dict

FORMATS = ("fivefold", "megatron", "rlinf", "skyrl", "torchrun")
_SECTIONS = ("parallel", "model", "training")


def _changed(cfg: Config, section: str) -> dict[str, object]:
    """The section's fields whose value is not the canonical default (what our YAML, RLinf and SkyRL
    keys mean when left out), plus those of _REQUIRED."""
    obj = getattr(cfg, section)
    default = type(obj)()
    return {f.name: getattr(obj, f.name) for f in fields(obj)
            if getattr(obj, f.name) != getattr(default, f.name)
            or f"{section}.{f.name}" in _REQUIRED and getattr(obj, f.name) is not None}


_REQUIRED = ("model.num_layers", "model.hidden_size", "model.ffn_hidden_size", "model.num_attention_heads",
             "model.vocab_size", "model.max_position_embeddings", "training.seq_length", "training.micro_batch_size",
             "training.global_batch_size", "training.train_iters", "training.lr")
"""Given on every emitted Megatron-LM line, default or not (Megatron requires most of them)."""


def _get(cfg: Config, dotted: str):
    section, name = dotted.split(".")
    if dotted == "model.ffn_hidden_size":
        return cfg.model.ffn_size  # as built: our canonical rounding is not Megatron's
    return getattr(getattr(cfg, section), name)


def _megatron_default(dotted: str, cfg: Config):
    """What a Megatron command line that leaves the field out means (fivefold.config.megatron_defaults)."""
    if dotted in DEFAULTS:
        return DEFAULTS[dotted]
    if dotted in MOE_DEFAULTS and cfg.model.num_experts:
        return MOE_DEFAULTS[dotted]
    section, name = dotted.split(".")
    return getattr(type(getattr(Config(), section))(), name)


def _flag_words(cfg: Config, dotted: str, value, ours: bool = True) -> list[str]:
    """The flag words that set `dotted` to `value`: its value flag (Megatron-LM's before ours), else the
    switch that stores `value`; [] when only a switch exists and `value` is what leaving it out means.
    `ours`: fivefold's own flags may be used (a line for `fivefold train`); else Megatron-LM's only (a
    `pretrain_gpt.py` line), where the schedule is what Megatron runs: interleaved with VPP, else 1F1B."""
    if dotted == "model.moe_first_k_dense_layers":  # Megatron-LM says it per layer
        return ["--moe-layer-freq", f"([0]*{value}+[1]*{cfg.model.num_layers - value})"]
    if dotted == "training.precision" and value == "fp8":  # fp8 GEMMs on bf16 parameters
        return ["--bf16"] + ([] if cfg.training.fp8_format else ["--fp8-format", "hybrid"])
    if not ours and dotted == "parallel.pipeline_schedule" and value == MEGATRON_SCHEDULE[
            (cfg.parallel.virtual_pipeline_model_parallel_size or 1) > 1]:
        return []
    flags = [name for name in flags_of(dotted) if ours or not FLAGS[name].ours]
    for name in flags:
        f = FLAGS[name]
        if f.kind == VALUE:
            return [name, _scalar(value)]
        if f.kind == LIST:
            return [name, *map(str, value)]
    for name in flags:
        if FLAGS[name].const == value:
            return [name]
    if value == _megatron_default(dotted, cfg):
        return []
    raise UserError(f"{dotted}={value!r} has no Megatron-LM flag, so a Megatron-LM command line cannot build this "
                    "config: emit it as fivefold YAML (--emit fivefold), RLinf YAML (--emit rlinf) or a `fivefold "
                    "train` line (--emit torchrun)")


MEGATRON_SCHEDULE = {False: "1f1b", True: "interleaved"}
"""The pipeline schedule Megatron-LM runs without and with virtual stages (it has no flag for it)."""


def megatron_words(cfg: Config, ours: bool = True) -> list[str]:
    """Megatron-LM flags that build `cfg` as Megatron-LM would read them: the fields of _REQUIRED, and
    every other field whose value is not what leaving its flag out means under Megatron's defaults
    (so --swiglu, --normalization RMSNorm, --disable-bias-linear, --position-embedding-type rope, ...
    appear). `fivefold.config.load` reads the words back to `cfg` (tests/test_planner_emit.py).
    `ours`: fivefold's own flags may be used (`_flag_words`)."""
    words: list[str] = []
    for section in _SECTIONS:
        for f in fields(getattr(cfg, section)):
            dotted = f"{section}.{f.name}"
            value = _get(cfg, dotted)
            if dotted in _REQUIRED and value is not None or value != _megatron_default(dotted, cfg):
                if dotted == "model.num_query_groups" and value is not None:
                    words.append(GQA_SWITCH)  # without it Megatron-LM ignores --num-query-groups
                words += _flag_words(cfg, dotted, value, ours)
    return words


def emit(cfg: Config, fmt: str, model_ref: str | None = None) -> str:
    """`cfg` as text in `fmt` (one of FORMATS)."""
    c = cfg.cluster
    if fmt == "fivefold":
        data = {"cluster": {"num_nodes": c.num_nodes, "gpus_per_node": c.gpus_per_node}}
        data |= {section: _changed(cfg, section) for section in _SECTIONS}
        head = f"# fivefold plan: {model_ref}\n" if model_ref else ""
        return head + yaml.safe_dump(data, sort_keys=False)
    if fmt == "megatron":
        launcher = f"torchrun --nproc_per_node={c.gpus_per_node} --nnodes={c.num_nodes} pretrain_gpt.py"
        return launcher + " \\\n  " + " \\\n  ".join(_pairs(megatron_words(cfg, ours=False)))
    if fmt == "torchrun":
        launcher = f"torchrun --nproc_per_node={c.gpus_per_node} --nnodes={c.num_nodes} -m fivefold train"
        return launcher + " \\\n  " + " \\\n  ".join(_pairs(megatron_words(cfg)))
    if fmt == "rlinf":
        model = {k: v for section in _SECTIONS for k, v in _changed(cfg, section).items()}
        if model.get("precision") == "fp8":  # RLinf's precision names the parameters' dtype; fp8 GEMMs are
            model["precision"] = "bf16"      # Megatron's TransformerConfig.fp8 beside it
            model["fp8"] = model.pop("fp8_format", None) or "hybrid"
        data = {"cluster": {"num_nodes": c.num_nodes, "num_gpus_per_node": c.gpus_per_node},
                "actor": {"model": model}}
        return yaml.safe_dump(data, sort_keys=False)
    if fmt == "skyrl":
        placement = {key: getattr(c, field.split(".")[1]) for key, field in SKYRL_CLUSTER.items()}
        return "\n".join([f"{k}={v}" for k, v in placement.items()]
                         + [f"trainer.policy.megatron_config.{k}={_scalar(v)}"
                            for section in _SECTIONS for k, v in _changed(cfg, section).items()])
    raise ValueError(f"unknown format {fmt!r}; use one of {FORMATS}")


def _scalar(v) -> str:
    if isinstance(v, (list, tuple)):  # Hydra's override syntax: no spaces
        return "[" + ",".join(map(_scalar, v)) + "]"
    return str(v).lower() if isinstance(v, bool) else str(v)


def _pairs(words: list[str]) -> list[str]:
    """Group flags with their value for one flag per line, quoted for a shell."""
    out: list[str] = []
    for w in map(shlex.quote, words):
        if w.startswith("--") or not out:
            out.append(w)
        else:
            out[-1] += " " + w
    return out


__all__ = ["FORMATS", "emit", "megatron_words", "to_dict"]
