"""`fivefold rl CONFIG.yaml [key=value ...] [--nproc N] [--out DIR]`: GRPO on a verifiable toy task
(fivefold.rl.grpo).

CONFIG is a fivefold YAML config (the actor's model, layout and training sections) with a `grpo:`
section (fivefold.rl.grpo.GRPOConfig: steps, prompts_per_step, group_size, lr, kl_coef, ...);
`grpo.steps=10` words override the section, the other words (`tp=1`, `training.clip_grad=0.5`) the
actor's config, as `fivefold train` takes them; a setting the rl job would not read (the learning-rate
schedule, iterations, batch: `GRPO_INSTEAD`; data, checkpoints, logging, evaluation: `NOT_IN_RL`) is
refused, naming what to give instead.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import yaml

from fivefold.cli._lock import holding, refuse_if_held
from fivefold.cli._outputs import output_folder
from fivefold.errors import NotImplementedYet, UserError, write_failed

HELP = "GRPO post-training on a verifiable toy task (actor, rollout and reference on every rank)"
ACCEPTS_EXTRA = True  # key=value overrides, grpo.* ones for the grpo: section


def add_arguments(p) -> None:
    p.add_argument("config", help="a fivefold YAML config with a grpo: section; then key=value overrides "
                                  "(grpo.steps=10 for the grpo: section, tp=1 for the actor)")
    p.add_argument("--nproc", type=int, default=None, help="local ranks (default: the config's world size)")
    p.add_argument("--out", default="runs/rl", help="output folder (metrics.jsonl, rl.png, logs)")


_CONSTANT_LR = "GRPO's learning rates are constant: grpo.lr (the RL steps) and grpo.warmup_lr (the warm-up)"
GRPO_INSTEAD = {
    "training.lr": _CONSTANT_LR, "training.min_lr": _CONSTANT_LR,
    **{f"training.{name}": _CONSTANT_LR for name in ("lr_decay_style", "lr_decay_iters", "lr_decay_samples",
                                                     "lr_warmup_iters", "lr_warmup_samples", "lr_warmup_fraction",
                                                     "lr_warmup_init")},
    **{f"training.{name}": "grpo.steps (and grpo.warmup_steps) count the steps"
       for name in ("train_iters", "train_samples", "exit_interval")},
    **{f"training.{name}": "grpo.prompts_per_step x grpo.group_size answers a step, grpo.warmup_batch a warm-up step"
       for name in ("global_batch_size", "step_batch_size_schedule")},
}
"""The actor's training keys `fivefold rl` does not read, and the grpo: key that does their work."""
NOT_IN_RL = ("data.", "checkpoint.", "logging.", "training.eval_interval", "training.eval_iters")
"""What `fivefold rl` has not built: the task generates its prompts, no checkpoint is loaded or saved,
metrics go to OUT/metrics.jsonl and rl.png, no evaluation (logging.moe_per_layer_logging excepted:
a MoE actor's loads are logged)."""


def _unread(explicit: set[str], precision: str, model) -> None:
    """Refuse a setting the rl job would not read (it ran as if the word were not there), and a model
    its rollout copy cannot generate with (a rank said so once the ranks had started)."""
    from fivefold.model.generate import model_features_not_generated

    instead = [f"{key} ({GRPO_INSTEAD[key]})" for key in sorted(explicit) if key in GRPO_INSTEAD]
    if instead:
        raise UserError("`fivefold rl` does not read " + "; ".join(instead) + ": give the grpo.* key instead")
    unbuilt = sorted(k for k in explicit if k.startswith(NOT_IN_RL) and k != "logging.moe_per_layer_logging")
    if precision != "fp32":  # the rollout copy is an fp32 model the actor's weights sync into
        unbuilt.append(f"training.precision={precision} (the rollout copy is fp32)")
    if unbuilt:
        raise NotImplementedYet(f"{', '.join(unbuilt)} in `fivefold rl` (its prompts come from the task; it loads "
                                "and saves no checkpoint; it writes OUT/metrics.jsonl and rl.png; drop them)")
    lacks = model_features_not_generated(model)
    if lacks:
        raise NotImplementedYet(f"`fivefold rl` of a model with {' and '.join(lacks)} (its rollout copy generates with "
                                "one dense GQA replica: give a dense model with grouped-query attention)")


def _pipeline(parallel) -> None:
    """The RL engine pipelines any number of micro-batches with a schedule built for one (1f1b, gpipe,
    zb-h1): an interleaved (VPP), DualPipeV or hand-written schedule is fixed to a micro-batch count."""
    vpp = parallel.virtual_pipeline_model_parallel_size or 1
    fixed = [what for what, bad in ((f"virtual_pipeline_model_parallel_size={vpp}", vpp > 1),
                                    (f"pipeline_schedule={parallel.pipeline_schedule}",
                                     parallel.pipeline_schedule in ("interleaved", "dualpipev")),
                                    (f"pipeline_schedule_csv={parallel.pipeline_schedule_csv}",
                                     parallel.pipeline_schedule_csv)) if bad]
    if fixed and parallel.pipeline_model_parallel_size > 1:
        raise NotImplementedYet(f"parallel.{', parallel.'.join(fixed)} in `fivefold rl` (its engine runs a pipeline "
                                "schedule for any number of micro-batches: 1f1b, gpipe or zb-h1; give one of them)")


def available_memory() -> int:
    """Bytes of host memory a job may still take: Linux's MemAvailable, within a cgroup's limit (a
    container's memory.max); elsewhere all of it."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        free = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return free
    return min(free, int(limit) - used) if limit.isdigit() else free


def run(args, extra: list[str]) -> int:
    from fivefold.config.load import load_config, parse_yaml
    from fivefold.config.schema import to_dict
    from fivefold.config.validate import layout_of, validate
    from fivefold.launch import launch, place
    from fivefold.rl.grpo import GRPOConfig
    from fivefold.watchdog import timeout_of

    refuse_if_held("--out", Path(args.out))
    path = Path(args.config)
    if not path.is_file():
        raise UserError(f"config file {args.config} not found")
    raw = parse_yaml(path)
    if not isinstance(raw, dict) or not isinstance(raw.get("grpo"), dict):
        raise UserError(f"{path}: needs a grpo: section (see examples/grpo.yaml)")
    grpo = raw.pop("grpo")
    for word in (w for w in extra if w.startswith("grpo.")):
        key, eq, value = word[len("grpo."):].partition("=")
        if not eq:
            raise UserError(f"{word}: give grpo.KEY=VALUE")
        grpo[key] = yaml.safe_load(value)
    g = GRPOConfig.of(grpo)  # unknown keys and values refused before any rank starts
    with tempfile.TemporaryDirectory() as tmp:  # the actor's section as a config of its own, read as any
        actor = Path(tmp) / "actor.yaml"
        actor.write_text(yaml.safe_dump(raw))
        loaded = load_config(str(actor), [w for w in extra if not w.startswith("grpo.")], world_size=args.nproc)
    _pipeline(loaded.config.parallel)  # before validate, whose batch rules name settings rl does not read
    validate(loaded.config, loaded.dialect, world_flag="--nproc" if args.nproc else None)
    _unread(loaded.explicit, loaded.config.training.precision, loaded.config.model)
    config = loaded.config
    nproc = config.cluster.resolved_world_size
    config.cluster.world_size = nproc
    g.check(nproc, layout_of(config).dp, config.training.seq_length)
    g.check_memory(config, nproc, available_memory())
    out = output_folder("--out", args.out)  # made once the run is known to be valid
    with holding("--out", out, "rl"):  # --out is this run's until the ranks end (fivefold.cli._lock)
        place(config, nproc)
        spec = out / "run.json"
        try:
            (out / "logs").mkdir(exist_ok=True)
            (out / "actor.yaml").write_text(yaml.safe_dump(raw))
            spec.write_text(json.dumps({"job": "rl", "config": to_dict(config), "grpo": grpo, "out": str(out),
                                        "data_dir": str(out)}, indent=1))
        except OSError as e:
            raise write_failed(e.filename or spec, e, "the ranks' job description") from None
        print(f"fivefold rl: {nproc} local ranks, output in {out}", file=sys.stderr)
        return launch(nproc, [str(spec)], out / "logs", timeout_s=timeout_of(config.training))
