"""Validation: every problem of a config at once, each naming field, value, rule and a fix.

The rules live in rules.py (over flat sizes), the fix search in fixes.py; this module applies a
dialect's own adjustments to the Config, and turns broken rules into `Problem`s.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from math import inf, isfinite

from fivefold.config.data_split import split_problem
from fivefold.config.fixes import first_that_holds, search
from fivefold.config.rules import KNOB_FIELDS, adjust, dp_of, errors, sizes_of
from fivefold.config.schema import DEVICES, FP8_FORMATS, FP8_RECIPES, Config
from fivefold.errors import UserError
from fivefold.config.batch_sizes import BatchSizes
from fivefold.topology import Layout


@dataclass(frozen=True)
class Problem:
    field: str
    """Dotted canonical field name, e.g. parallel.tensor_model_parallel_size."""
    value: object
    rule: str
    fix: str
    """A value that would work, e.g. 'tensor_model_parallel_size=2'."""
    severity: str = "error"
    """error, or warning (the config was adjusted or is legal but slow)."""

    def __str__(self) -> str:
        fix = "" if self.fix == "applied" else f" (fix: {self.fix})"
        return f"{self.severity}: {self.field}={self.value!r}: {self.rule}{fix}"


class ConfigError(UserError):
    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))


def validate(config: Config, dialect: str = "fivefold", *, raise_errors: bool = True,
             world_flag: str | None = None) -> list[Problem]:
    """All problems of `config` read in `dialect`; adjustments the dialect makes are applied to `config`.

    Raises ConfigError listing every problem (errors first, then warnings) when any is an error and
    `raise_errors`; otherwise returns the problems (only warnings when `raise_errors`). `world_flag`: the
    command-line flag that set the world size (`--nproc`), which a fix names instead of `world_size=N`
    (a world_size=N word would not override the flag).
    """
    s = sizes_of(config)
    base = dict(s)
    warned = adjust(s, dialect)
    broken = errors(s)
    fixes = search(base, broken, dialect) if broken else {}
    problems = [Problem(r.field, r.value, r.rule,
                        _world_as(world_flag, first_that_holds(config, fixes.get(i, []), dialect)))
                for i, r in enumerate(broken)]
    problems += _training_problems(config.training, None if broken else dp_of(s) * s["cp"]) \
        + _data_problems(config.data) + _module_problems(config.training) + _cluster_problems(config.cluster) \
        + _range_problems(config)
    warnings = [Problem(r.field, r.value, r.rule, "applied", "warning") for r in warned]
    if not broken:
        warnings += _soft_warnings(s)
        _write_back(config, s)
        problems += _schedule_problems(config.training, s)
        if config.logging.trace_schedule and s["pp"] == 1:  # it would do nothing, silently
            problems.append(Problem("logging.trace_schedule", True, "times the pipeline's actions of the last step: "
                                    "needs pipeline_model_parallel_size > 1", "trace_schedule=false"))
        if config.training.train_samples is not None and not problems:  # Megatron's iteration count
            t = config.training
            t.train_iters = BatchSizes.of(t).steps_for_samples(t.train_samples)
    if problems and raise_errors:
        raise ConfigError(problems + warnings)
    return problems + warnings


def _world_as(flag: str | None, fix: str) -> str:
    """`fix` ('world_size=4, global_batch_size=16') with its world size given as `flag` ('--nproc 4')."""
    if flag is None:
        return fix
    return ", ".join(f"{flag} {part[len('world_size='):]}" if part.startswith("world_size=") else part
                     for part in fix.split(", "))


STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
"""Megatron-LM's --lr-decay-style choices (the runtime runs the first three: train.supported)."""
OPTIMIZER_DTYPES = ("fp32", "bf16", "fp16", "fp8")
"""Megatron's --exp-avg-dtype / --exp-avg-sq-dtype choices."""


def _schedule_problems(t, s: dict) -> list[Problem]:
    """Each batch of a step batch-size schedule obeys the global batch's rules (divisible by micro batch x
    DP; the pipeline schedule's microbatch count), checked as if it were the global batch."""
    if not t.step_batch_size_schedule:
        return []
    out = []
    for _, batch in BatchSizes.of(t).entries:
        for r in errors(dict(s, gbs=batch)):
            out.append(Problem("training.step_batch_size_schedule", t.step_batch_size_schedule,
                               f"its batch {batch}: {r.rule}", "make every batch of the schedule a multiple of "
                               f"micro batch x DP = {s['mbs'] * dp_of(s)}"))
    return out


def _module_problems(t) -> list[Problem]:
    """Megatron's --recompute-modules and --offload-modules: known names, and the switch each needs."""
    from fivefold.config.modules import OFFLOAD_MODULES, RECOMPUTE_MODULES
    out = []
    for field, names, known, needs, fix in (
            ("recompute_modules", t.recompute_modules, RECOMPUTE_MODULES, t.recompute_granularity == "selective",
             "recompute_granularity=selective (--recompute-granularity selective)"),
            ("offload_modules", t.offload_modules, OFFLOAD_MODULES, t.fine_grained_activation_offloading,
             "fine_grained_activation_offloading=True (--fine-grained-activation-offloading)")):
        unknown = [n for n in names or () if n not in known]
        if unknown:
            out.append(Problem(f"training.{field}", names, f"unknown {', '.join(map(str, unknown))}; the modules are "
                               f"{', '.join(known)}", f"{field}=[{', '.join(n for n in names if n in known)}]"))
        elif names and not needs:
            out.append(Problem(f"training.{field}", names, "the modules take effect only with their switch", fix))
    return out


def _cluster_problems(c) -> list[Problem]:
    if c.device not in DEVICES:
        return [Problem("cluster.device", c.device, f"must be one of {', '.join(DEVICES)}", "device=auto")]
    return []


def _data_problems(d) -> list[Problem]:
    if d.tokenizer_type == "HuggingFaceTokenizer" and d.tokenizer == "byte":
        return [Problem("data.tokenizer", d.tokenizer, "tokenizer_type HuggingFaceTokenizer needs the tokenizer's "
                        "local folder (--tokenizer-model DIR, holding tokenizer.json)", "data.tokenizer=DIR")]
    if d.tokenizer_type == "GPT2BPETokenizer" and not (d.vocab_file and d.merge_file):
        return [Problem("data.tokenizer_type", d.tokenizer_type, "GPT2BPETokenizer needs GPT-2's vocab.json and "
                        "merges.txt", "--vocab-file FILE --merge-file FILE")]
    return []


def _training_problems(t, dp_cp: int | None) -> list[Problem]:
    """The data-parallel mode, mixed precision, loss scaling and optimizer offload
    (fivefold.parallel.data.data_parallel, fivefold.config.precision), as Megatron checks them; `dp_cp`:
    the size of the DP x CP group (None: the layout is broken, already reported)."""
    out = []
    n = t.num_distributed_optimizer_instances
    if not isinstance(n, int) or n < 1 or (dp_cp is not None and dp_cp % n):
        out.append(Problem("training.num_distributed_optimizer_instances", n, f"must be a whole number >= 1 "
                           f"dividing DP x CP = {dp_cp}", "num_distributed_optimizer_instances=1"))
    elif n > 1 and t.sharding_strategy == "no_shard":
        out.append(Problem("training.num_distributed_optimizer_instances", n, "HSDP shards within an instance: it "
                           "needs a sharded mode", "use_distributed_optimizer=True (--use-distributed-optimizer)"))
    if t.data_parallel_sharding_strategy not in (None, *STRATEGIES):
        out.append(Problem("training.data_parallel_sharding_strategy", t.data_parallel_sharding_strategy,
                           f"must be one of {', '.join(STRATEGIES)}", "data_parallel_sharding_strategy=optim"))
    if t.optimizer_cpu_offload and not t.use_precision_aware_optimizer:
        out.append(Problem("training.optimizer_cpu_offload", True, "optimizer CPU offload needs the precision-aware "
                           "optimizer (Megatron asserts the same)", "use_precision_aware_optimizer=True "
                           "(--use-precision-aware-optimizer)"))
    for name, choices in (("exp_avg_dtype", OPTIMIZER_DTYPES), ("exp_avg_sq_dtype", OPTIMIZER_DTYPES),
                          ("main_params_dtype", ("fp32", "fp16"))):
        value = getattr(t, name)
        if value not in choices:
            out.append(Problem(f"training.{name}", value, f"must be one of {', '.join(choices)}", f"{name}=fp32"))
        elif value != "fp32" and not t.use_precision_aware_optimizer:
            out.append(Problem(f"training.{name}", value, "only the precision-aware optimizer keeps optimizer state "
                               "other than fp32 (Megatron asserts the same)",
                               "use_precision_aware_optimizer=True (--use-precision-aware-optimizer)"))
    if not isinstance(t.manual_gc_interval, int) or t.manual_gc_interval < 0:
        out.append(Problem("training.manual_gc_interval", t.manual_gc_interval, "must be a whole number >= 0 "
                           "(0: no collection between steps; Megatron asserts the same)", "manual_gc_interval=0"))
    if t.fp8_format not in (None, *FP8_FORMATS):
        out.append(Problem("training.fp8_format", t.fp8_format, f"must be one of {', '.join(FP8_FORMATS)}",
                           "fp8_format=hybrid (--fp8-format hybrid)"))
    if t.fp8_recipe not in FP8_RECIPES:
        out.append(Problem("training.fp8_recipe", t.fp8_recipe, f"must be one of {', '.join(FP8_RECIPES)} (Megatron's "
                           "custom quantizer factory is not built)", "fp8_recipe=delayed (--fp8-recipe delayed)"))
    if t.fp8_param_gather and t.precision != "fp8":
        out.append(Problem("training.fp8_param_gather", True, f"fp8 primary weights need fp8 training (precision is "
                           f"{t.precision})", "precision=fp8, or drop --fp8-param-gather"))
    if not 0.0 < t.optimizer_offload_fraction <= 1.0:
        out.append(Problem("training.optimizer_offload_fraction", t.optimizer_offload_fraction,
                           "the offloaded share must be in (0, 1]", "optimizer_offload_fraction=1.0"))
    if t.grad_reduce_in_bf16 and t.precision not in ("bf16", "fp8"):
        out.append(Problem("training.grad_reduce_in_bf16", True, f"bf16 gradient reduction needs bf16 parameters "
                           f"(precision is {t.precision})", "precision=bf16 (--bf16), or drop --grad-reduce-in-bf16"))
    for name, value, ok, fix in (
            ("loss_scale", t.loss_scale, t.loss_scale is None or t.loss_scale > 0, "unset (dynamic scaling)"),
            ("initial_loss_scale", t.initial_loss_scale, t.initial_loss_scale > 0, "initial_loss_scale=4294967296"),
            ("min_loss_scale", t.min_loss_scale, 0 < t.min_loss_scale <= t.initial_loss_scale, "min_loss_scale=1"),
            ("loss_scale_window", t.loss_scale_window, t.loss_scale_window >= 1, "loss_scale_window=1000"),
            ("hysteresis", t.hysteresis, t.hysteresis >= 1, "hysteresis=2")):
        if not ok:
            out.append(Problem(f"training.{name}", value, "must be positive (min_loss_scale at most "
                               "initial_loss_scale)", fix))
    return out


def _range_problems(config: Config) -> list[Problem]:
    """The run's counts, intervals and optimizer numbers within their range, as Megatron's LR scheduler
    (min_lr >= 0, lr >= min_lr and its warm-up start, weight decay >= 0, decay steps > 0) and
    torch.optim.AdamW (betas in [0, 1), eps >= 0) assert them; a negative interval or clip would
    otherwise run as something else (Python's % of a negative interval, no clipping)."""
    t, d = config.training, config.data
    none_or = lambda v, ok: v is None or ok(v)  # noqa: E731
    under_lr = lambda v: 0 <= v and (not 0 <= t.lr < inf or v <= t.lr)  # noqa: E731 (a bad lr is reported alone)
    out = []
    for field, value, ok, rule, fix in (
            ("training.train_iters", t.train_iters, none_or(t.train_iters, lambda v: v >= 1), "must be >= 1",
             "train_iters=10"),
            ("training.lr", t.lr, 0 <= t.lr < inf, "must be a finite number >= 0", "lr=1e-3"),
            ("training.min_lr", t.min_lr, under_lr(t.min_lr), f"must be in [0, lr={t.lr}] (Megatron asserts it)",
             "min_lr=0"),
            ("training.lr_warmup_init", t.lr_warmup_init, under_lr(t.lr_warmup_init),
             f"must be in [0, lr={t.lr}] (Megatron asserts it)", "lr_warmup_init=0"),
            ("training.lr_warmup_iters", t.lr_warmup_iters, t.lr_warmup_iters >= 0, "must be >= 0",
             "lr_warmup_iters=0"),
            ("training.lr_warmup_samples", t.lr_warmup_samples, t.lr_warmup_samples >= 0, "must be >= 0",
             "lr_warmup_samples=0"),
            ("training.lr_warmup_fraction", t.lr_warmup_fraction, none_or(t.lr_warmup_fraction, lambda v: 0 <= v <= 1),
             "must be in [0, 1], or unset", "lr_warmup_fraction=0.01"),
            ("training.lr_decay_style", t.lr_decay_style, t.lr_decay_style in LR_DECAY_STYLES,
             f"must be one of {', '.join(LR_DECAY_STYLES)} (Megatron-LM's --lr-decay-style)", "lr_decay_style=cosine"),
            ("training.lr_decay_iters", t.lr_decay_iters, none_or(t.lr_decay_iters, lambda v: v >= 1),
             "must be >= 1 (Megatron asserts decay steps > 0), or unset for train_iters", "lr_decay_iters=10"),
            ("training.weight_decay", t.weight_decay, t.weight_decay >= 0, "must be >= 0", "weight_decay=0.01"),
            ("training.adam_beta1", t.adam_beta1, 0 <= t.adam_beta1 < 1, "must be in [0, 1)", "adam_beta1=0.9"),
            ("training.adam_beta2", t.adam_beta2, 0 <= t.adam_beta2 < 1, "must be in [0, 1)", "adam_beta2=0.95"),
            ("training.adam_eps", t.adam_eps, t.adam_eps >= 0, "must be >= 0", "adam_eps=1e-8"),
            ("training.clip_grad", t.clip_grad, t.clip_grad >= 0, "must be >= 0 (0: no clipping)", "clip_grad=1.0"),
            ("model.init_method_std", config.model.init_method_std, config.model.init_method_std >= 0,
             "must be >= 0", "init_method_std=0.02"),
            ("model.hidden_dropout", config.model.hidden_dropout, 0 <= config.model.hidden_dropout <= 1,
             "must be a probability, in [0, 1]", "hidden_dropout=0"),
            ("model.attention_dropout", config.model.attention_dropout, 0 <= config.model.attention_dropout <= 1,
             "must be a probability, in [0, 1]", "attention_dropout=0"),
            ("training.seed", t.seed, t.seed >= 0, "must be >= 0 (numpy's generators take no negative seed)",
             "seed=1234"),
            ("training.eval_interval", t.eval_interval, none_or(t.eval_interval, lambda v: v >= 0),
             "must be >= 0 (0 or unset: no evaluation)", "eval_interval=0"),
            ("training.eval_iters", t.eval_iters, t.eval_iters >= 0, "must be >= 0 (0: no evaluation, as Megatron)",
             "eval_iters=2"),
            ("checkpoint.save_interval", config.checkpoint.save_interval,
             none_or(config.checkpoint.save_interval, lambda v: v >= 0),
             "must be >= 0 (0 or unset: save at the end only)", "save_interval=0"),
            ("data.max_documents", d.max_documents, none_or(d.max_documents, lambda v: v >= 1),
             "must be >= 1, or unset for all", "max_documents=1000"),
            ("data.eval_fraction", d.eval_fraction, 0 <= d.eval_fraction < 1,
             "must be a share of the documents, in [0, 1)", "eval_fraction=0.05"),
            ("model.norm_epsilon", config.model.norm_epsilon, config.model.norm_epsilon > 0, "must be > 0",
             "norm_epsilon=1e-5"),
            ("model.rotary_base", config.model.rotary_base, config.model.rotary_base > 0, "must be > 0",
             "rotary_base=10000")):
        if not ok:
            out.append(Problem(field, value, rule, fix))
    named = {p.field for p in out}
    for section, name, value, default in _floats(config):  # inf / nan where no rule above names the field
        if f"{section}.{name}" not in named and not isfinite(value):
            fix = f"{name}={default}" if isinstance(default, (int, float)) else f"leave {name} unset"
            out.append(Problem(f"{section}.{name}", value, "must be a finite number", fix))
    if d.split is not None and split_problem(d.split):  # Megatron's --split, as the data loader reads it
        out.append(Problem("data.split", d.split, split_problem(d.split), "split=969,30,1"))
    return out


def _floats(config: Config):
    """(section, field, value, default) of every float-valued field of `config`."""
    for section, part in vars(config).items():
        for f in fields(part):
            value = getattr(part, f.name)
            if isinstance(value, float):
                yield section, f.name, value, f.default


def _write_back(config: Config, s: dict) -> None:
    for knob in ("vpp", "vpp_layers", "schedule", "sp", "gbs", "group"):
        section, name = KNOB_FIELDS[knob].split(".")
        setattr(getattr(config, section), name, s[knob])
    if s["pp_layout"]:  # the string's stages, resolved by rules.adjust
        config.parallel.pipeline_layers_per_stage = list(s["split"])


def _soft_warnings(s: dict) -> list[Problem]:
    """Legal but slow: TP groups that span a node boundary (the first few thousand groups are read by
    arithmetic; their pattern repeats, so a crossing shows early)."""
    tp, gpn = s["tp"], s["gpn"]
    if tp <= 1 or s["world"] <= gpn or (gpn % tp == 0 and s["order"].startswith("tp")):
        return []
    topo = Layout(tp=tp, cp=s["cp"], pp=s["pp"], dp=dp_of(s), order=s["order"]).dense
    for k in range(min(topo.num_groups("tp"), 4096)):
        first, last = topo.member(k, 0, "tp"), topo.member(k, tp - 1, "tp")
        if first // gpn != last // gpn:
            shown = [topo.member(k, j, "tp") for j in range(min(tp, 8))]
            group = ",".join(map(str, shown)) + (f",...,{last}" if tp > 8 else "")
            return [Problem(KNOB_FIELDS["tp"], tp, f"TP group [{group}] spans nodes {first // gpn}-{last // gpn}: "
                            f"it crosses a node boundary ({gpn} GPUs per node); TP all-reduces "
                            "then run over the inter-node network", f"tensor_model_parallel_size<={gpn} "
                            f"dividing {gpn}", "warning")]
    return []


def layout_of(config: Config) -> Layout:
    """The dense + expert grids a (valid) config asks for."""
    p, world = config.parallel, config.cluster.resolved_world_size
    tp, cp, pp = p.tensor_model_parallel_size, p.context_parallel_size, p.pipeline_model_parallel_size
    etp = p.expert_tensor_parallel_size if p.expert_tensor_parallel_size is not None else tp
    a2a = {"p2p": 1, "allgather": 1, "a2a": cp}.get(p.cp_comm_type) or (p.hierarchical_context_parallel_sizes or [1])[0]
    return Layout(tp=tp, cp=cp, pp=pp, dp=world // (tp * cp * pp), ep=p.expert_model_parallel_size, etp=etp,
                  order=p.order, cp_a2a=a2a if cp > 1 else 1, cp_gather=cp > 1 and p.cp_comm_type == "allgather")
