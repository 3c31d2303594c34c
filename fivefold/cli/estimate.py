"""`fivefold estimate`: memory per GPU and step time of one given layout (the one a user runs); of each
model of a `models:` list, a forward-only one (a reference, a reward model: `allocation.role_of`) sized
and timed as its forward (planner/search/forward.py)."""
from __future__ import annotations

import dataclasses

from fivefold.cli._planner_args import SEQ, add_hardware_arguments, assumptions_of, hardware_of, positive_int
from fivefold.cli.validate import split_config_arg
from fivefold.config.report import gpu_ranges
from fivefold.config.load import load_config
from fivefold.config.schema import TrainingConfig
from fivefold.config.validate import validate
from fivefold.errors import UserError
from fivefold.planner.search.forward import evaluate_forward
from fivefold.planner.presets.model_spec import resolve_model
from fivefold.planner.report.tables import breakdown
from fivefold.planner.calibration.runtime import apply, profile
from fivefold.planner.search.ranking import evaluate

HELP = "memory per GPU and step time of one layout (a config, or --model with overrides / Megatron flags)"
ACCEPTS_EXTRA = True
CPU_SEQ = TrainingConfig().seq_length
"""The canonical config's sequence length, a size for CPU test runs: `estimate` takes plan's in its place."""


def add_arguments(p) -> None:
    # CONFIG is the first leftover word (see validate.split_config_arg): a flag's value is never taken for it.
    p.usage = "fivefold estimate [CONFIG] [key=value ...] [--megatron-flag VALUE ...] [--model M] [--gpus N]"
    p.epilog = (f"The sequence and batch are the config's or Megatron's flags (--seq-length, --global-batch-size, "
                f"--micro-batch-size); where no source gives a sequence, {SEQ} tokens, as plan's default.")
    p.add_argument("--model", help="preset name or Hugging Face config.json (replaces the config's model; model "
                                   "flags and key=value words, e.g. --num-layers 16, apply to it)")
    p.add_argument("--gpus", type=positive_int, help="total GPUs (default: the config's world size)")
    add_hardware_arguments(p)


def run(args, extra) -> int:
    hw = hardware_of(args)
    path, words = split_config_arg(extra)
    loaded = load_config(path, words, world_size=args.gpus, gpus_per_node=args.gpus_per_node)
    cfg = loaded.config
    if "cluster.gpus_per_node" not in loaded.explicit:  # the config's own (and the world it makes) stands
        cfg.cluster.gpus_per_node = hw.gpus_per_node
    if args.model:  # replaces the config file's model; the words' model fields apply to it (they were dropped)
        given = sorted({k.split(".", 1)[1] for k in load_config(None, words).explicit if k.startswith("model.")}) \
            if words else []
        cfg.model = dataclasses.replace(resolve_model(args.model).model, **{f: getattr(cfg.model, f) for f in given})
        if given:
            print(f"note: --model {args.model} with " + ", ".join(f"model.{f}={getattr(cfg.model, f)}" for f in given))
    components = loaded.allocation.components if loaded.allocation else ()
    if not args.model and len(components) <= 1 and not any(k.startswith("model.") for k in loaded.explicit):
        raise UserError(f"{path or 'no config'}: sets no model field (num_layers, hidden_size, ...; it would size "
                        "the 2-layer test model): give --model (a preset or a config.json) or a config with the model")
    if len(components) <= 1:
        _estimate(cfg, loaded, args, hw)
        return 0
    for c in components:  # each model of a `models:` list or allocation mode on its own GPUs (the first alone was)
        print(f"== {c.name} ({c.role}) on GPUs {gpu_ranges(c.ranks)}")
        if c.config is None:
            print("an inference engine: not estimated (the planner times training steps)")
            continue
        if args.model:
            c.config.model = cfg.model
        _estimate(c.config, loaded, args, hw, forward_only=c.role == "forward-only")
    return 0


def _estimate(cfg, loaded, args, hw, forward_only: bool = False) -> None:
    """Validate `cfg` as the GPU run it describes (bf16, plan's sequence where none was given) and
    print its memory and step time (`forward_only`: as a forward-only model, its forward's time)."""
    if cfg.training.precision not in ("bf16", "fp8"):
        cfg.training.precision = "bf16"
        print("note: precision set to bf16 for the GPU estimate")
    # no source gave a sequence and no dialect a default of its own (Megatron-Bridge's 1024 stands)
    if "training.seq_length" not in loaded.explicit and cfg.training.seq_length == CPU_SEQ:
        cfg.training.seq_length = SEQ
        print(f"note: sequence length {SEQ} for the GPU estimate, as plan's default (no source gave one): "
              "give --seq-length to choose")
    # every error with its fix; fills Megatron's defaults (global batch)
    for w in validate(cfg, loaded.dialect, world_flag="--gpus" if args.gpus else None):
        print(w)
    if "training.global_batch_size" not in loaded.explicit and cfg.training.global_batch_size:
        print(f"note: global batch {cfg.training.global_batch_size} = micro-batch x DP, Megatron-LM's default (no "
              "source gave one): one microbatch per " + ("forward" if forward_only else
                                                       "step, no accumulation to hide the gradient reduction behind")
              + "; give --global-batch-size to choose")
    mem, ta = assumptions_of(args)
    problem = hw.fp8_recipe_problem(cfg.training.precision, cfg.training.fp8_recipe)
    if problem:
        raise UserError(problem)
    rt = profile(args.runtime)
    runs = apply(cfg, rt)
    if forward_only:
        _forward_notes(cfg)
    elif runs.training.grad_reduce_in_bf16 != cfg.training.grad_reduce_in_bf16:
        print(f"note: gradients reduced in bf16, as {rt.name} does (the config has grad_reduce_in_bf16=False)")
    if runs.parallel.moe_token_dispatcher_type != cfg.parallel.moe_token_dispatcher_type:
        print(f"note: the EP exchange timed as an all-to-all, as {rt.name} sends it (the config names the "
              f"{cfg.parallel.moe_token_dispatcher_type} dispatcher: --runtime megatron-te times it)")
    if ta.tp_overlap and runs.parallel.tensor_model_parallel_size > 1:
        print(f"note: TP traffic {'overlapped' if runs.parallel.tp_comm_overlap else 'exposed'}: {rt.name} hides "
              f"{ta.tp_overlap:.0%} of it with TP communication overlap, which the config turns "
              + ("on" if runs.parallel.tp_comm_overlap else "off (Megatron's --tp-comm-overlap, torchtitan's async "
                                                            "TP; parallel.tp_comm_overlap, with sequence parallelism)"))
    cand = evaluate_forward(runs, hw, mem, ta) if forward_only else evaluate(runs, hw, mem, ta)
    if cand.estimate is None and not cand.problem.startswith("needs"):
        raise UserError(f"invalid layout: {cand.problem}")
    print(breakdown(cand, hw, forward_only))


def _forward_notes(cfg) -> None:
    """What a forward-only model's estimate leaves out of its config's training settings."""
    t = cfg.training
    if t.sharding_strategy == "optim_grads_params":
        print("note: forward-only: its weights sized whole on every DP rank, as a frozen copy is held (the config's "
              "ZeRO-3 would shard them over DP and gather each layer for every forward)")
    if t.recompute_granularity:
        print(f"note: forward-only: recompute_granularity={t.recompute_granularity} has nothing to recompute "
              "(no backward)")
