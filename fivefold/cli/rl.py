"""`fivefold rl CONFIG.yaml [key=value ...] [--nproc N] [--out DIR]`: GRPO on a verifiable toy task
(fivefold.rl.grpo).

CONFIG is a fivefold YAML config (the actor's model, layout and training sections) with a `grpo:`
section (fivefold.rl.grpo.GRPOConfig: steps, prompts_per_step, group_size, lr, kl_coef, ...);
`grpo.steps=10` words override the section, the other words (`training.lr=1e-4`, `tp=1`) the
actor's config, as `fivefold train` takes them.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import yaml

from fivefold.cli._outputs import output_folder
from fivefold.errors import UserError

HELP = "GRPO post-training on a verifiable toy task (actor, rollout and reference on every rank)"
ACCEPTS_EXTRA = True  # key=value overrides, grpo.* ones for the grpo: section


def add_arguments(p) -> None:
    p.add_argument("config", help="a fivefold YAML config with a grpo: section; then key=value overrides "
                                  "(grpo.steps=10 for the grpo: section, training.lr=1e-4 for the actor)")
    p.add_argument("--nproc", type=int, default=None, help="local ranks (default: the config's world size)")
    p.add_argument("--out", default="runs/rl", help="output folder (metrics.jsonl, rl.png, logs)")


def run(args, extra: list[str]) -> int:
    from fivefold.config.load import load_config, parse_yaml
    from fivefold.config.schema import to_dict
    from fivefold.config.validate import layout_of, validate
    from fivefold.launch import launch, place
    from fivefold.rl.grpo import GRPOConfig
    from fivefold.watchdog import timeout_of

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
    validate(loaded.config, loaded.dialect, world_flag="--nproc" if args.nproc else None)
    config = loaded.config
    nproc = config.cluster.resolved_world_size
    config.cluster.world_size = nproc
    g.check(nproc, layout_of(config).dp, config.training.seq_length)
    out = output_folder("--out", args.out)  # made once the run is known to be valid
    (out / "logs").mkdir(exist_ok=True)
    (out / "actor.yaml").write_text(yaml.safe_dump(raw))
    place(config, nproc)
    spec = out / "run.json"
    spec.write_text(json.dumps({"job": "rl", "config": to_dict(config), "grpo": grpo, "out": str(out),
                                "data_dir": str(out)}, indent=1))
    print(f"fivefold rl: {nproc} local ranks, output in {out}", file=sys.stderr)
    return launch(nproc, [str(spec)], out / "logs", timeout_s=timeout_of(config.training))
