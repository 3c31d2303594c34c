"""`fivefold validate CONFIG [overrides] [megatron flags] [--world-size N | --nodes N --gpus-per-node G]`."""
from __future__ import annotations

import argparse

from fivefold.config.load import load_config
from fivefold.config.report import gpu_ranges, layout_report
from fivefold.config.rules import sizes_of, stage_layers
from fivefold.config.schema import Config
from fivefold.config.validate import ConfigError, Problem, layout_of, validate
from fivefold.errors import UserError

HELP = "check a config in any dialect; print its layout (ranks, groups) or every problem with its fix"
ACCEPTS_EXTRA = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    # CONFIG and the words after it are taken from the words argparse leaves over (see split_config_arg),
    # so that a Megatron flag's value is never mistaken for the config file.
    p.usage = ("fivefold validate [CONFIG] [key=value ...] [--megatron-flag VALUE ...] "
               "[--world-size N | --nodes N --gpus-per-node G]")
    p.description = (HELP + ". CONFIG: YAML (ours or RLinf's) or a .txt of flags/overrides/allocation_mode.")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--world-size", type=int, help="total ranks (default nodes x GPUs per node)")
    g.add_argument("--nodes", type=int, help="number of nodes")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default 8)")
    p.add_argument("--all-ranks", action="store_true", help="print every rank, not the first and last")


def split_config_arg(extra: list[str]) -> tuple[str | None, list[str]]:
    """The config file is the first leftover word when it is neither a flag nor key=value."""
    if extra and not extra[0].startswith("-") and "=" not in extra[0] and extra[0] != "torchrun":
        return extra[0], list(extra[1:])
    return None, list(extra)


def describe(cfg: Config, all_ranks: bool, ranks: tuple[int, ...] | None = None) -> str:
    """The resolved layout of a validated config (`ranks`: global GPU of each local rank)."""
    lay = layout_of(cfg)
    m, p = cfg.model, cfg.parallel
    s = sizes_of(cfg)
    lines = [layout_report(lay, ranks, all_ranks)]
    group = f" microbatch group={p.microbatch_group_size_per_vp_stage}" if p.microbatch_group_size_per_vp_stage else ""
    lines.append(f"sequence_parallel={p.sequence_parallel} schedule={p.pipeline_schedule} "
                 f"vpp={p.virtual_pipeline_model_parallel_size}{group} layers per stage={_short_list(stage_layers(s))}")
    lines.append(f"global batch={cfg.training.global_batch_size} micro batch={cfg.training.micro_batch_size} "
                 f"microbatches={cfg.training.global_batch_size // (cfg.training.micro_batch_size * lay.dp)}")
    lines.append(f"vocab {m.vocab_size} padded to {m.padded_vocab_size(lay.tp)} "
                 f"(multiple of {m.make_vocab_size_divisible_by} x TP; padded logits masked out of the loss)")
    return "\n".join(lines)


def _print_problems(problems: list[Problem]) -> None:
    for w in problems:
        print(w)


def _vocab_from_tokenizer(config: Config) -> list[Problem]:
    """The model's vocabulary sized by a Megatron tokenizer the data section names, as `train` sizes it
    (fivefold.data.tokenizer.fitted_tokenizer), so that the padding printed is the run's."""
    d = config.data
    if not (d.tokenizer_type or d.vocab_file) or config.checkpoint.load_hf:
        return []
    from fivefold.data.tokenizer import fitted_tokenizer

    before = config.model.vocab_size
    try:
        _, note = fitted_tokenizer(config)
    except UserError as e:  # its files are not on this machine: the layout is still checked
        return [Problem("data.tokenizer_type", d.tokenizer_type, f"not read here ({e}); the vocabulary is "
                        f"model.vocab_size={before}, which train sets from the tokenizer", "applied", "warning")]
    return [Problem("model.vocab_size", before, note, "applied", "warning")] if note else []


def run(args, extra) -> int:
    path, words = split_config_arg(extra)
    loaded = load_config(path, words, world_size=args.world_size, nodes=args.nodes,
                         gpus_per_node=args.gpus_per_node)
    print(f"dialect: {loaded.dialect}")
    _print_problems(loaded.warnings + _vocab_from_tokenizer(loaded.config))
    alloc = loaded.allocation
    if alloc is None:
        _print_problems(validate(loaded.config, loaded.dialect, world_flag="--world-size" if args.world_size else None))
        print(describe(loaded.config, args.all_ranks))
        return 0
    failed: list[str] = []
    for comp in alloc.components:
        print(f"== {comp.name} ({comp.role}) on GPUs {gpu_ranges(comp.ranks)}")
        if comp.config is None:
            print(layout_report(comp.layout, comp.ranks, args.all_ranks))
            continue
        try:
            _print_problems(validate(comp.config, loaded.dialect))
        except ConfigError as e:
            failed.append(f"{comp.name}:\n{e}")
            continue
        print(describe(comp.config, args.all_ranks, comp.ranks))
    if failed:
        raise UserError("\n".join(failed))
    return 0


def _short_list(values: list[int]) -> str:
    if len(values) <= 16:
        return str(values)
    return "[" + ", ".join(map(str, values[:8])) + f", ... {len(values)} stages ..., " + \
        ", ".join(map(str, values[-4:])) + "]"
