"""`fivefold train [CONFIG] [overrides ...] [megatron flags ...] --out OUT [--nproc N]`.

Loads and validates the config, refuses knobs the runtime does not run yet, prepares the data once
(tokenized into OUT/data), then starts the ranks itself (`--nproc`, default the layout's world size),
or, under torchrun (RANK / WORLD_SIZE in the environment), runs as the rank torchrun started.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from fivefold.cli._lock import holding, refuse_if_held
from fivefold.cli._outputs import check_output_folder, output_folder, removed_if_refused
from fivefold.cli.validate import split_config_arg
from fivefold.config.schema import Config, to_dict
from fivefold.errors import UserError, write_failed

HELP = "train a model (spawns local ranks, or runs under torchrun)"
ACCEPTS_EXTRA = True


def add_arguments(parser) -> None:
    # CONFIG is the first leftover word (validate.split_config_arg): a Megatron command line without a
    # file (`train --num-layers 2 ... --out DIR`) never has a flag's value taken for the config
    parser.usage = ("fivefold train [CONFIG] --out DIR [key=value ...] [--megatron-flag VALUE ...] [--nproc N] "
                    "[--trace-schedule]")
    parser.description = (HELP + ". CONFIG: a YAML config (our sections, RLinf's, Megatron-Bridge's) or a .txt of "
                          "words (a Megatron-LM command line, SkyRL / Bridge overrides); key=value words and Megatron "
                          "flags after it override it, or are the whole config (docs/config.md)")
    parser.add_argument("--out", required=True, help="output folder: metrics.jsonl, loss.png, checkpoints, logs")
    parser.add_argument("--nproc", "--world-size", dest="nproc", type=int, default=None,
                        help="local ranks to start (default: the layout's world size; --world-size, as validate "
                             "takes it, is the same)")
    parser.add_argument("--trace-schedule", action="store_true",
                        help="with PP > 1: time the pipeline actions of the last step, draw OUT/schedule_trace.png")


def _load(path: str | None, words: list[str], world_size: int | None, trace_schedule: bool = False,
          world_flag: str | None = None) -> Config:
    from fivefold.config.load import load_config
    from fivefold.config.validate import validate

    loaded = load_config(path, words, world_size=world_size)
    for w in loaded.warnings:
        print(w, file=sys.stderr)
    _check_one_model(loaded.allocation)
    loaded.config.logging.trace_schedule |= trace_schedule  # --trace-schedule, validated as the key is
    for w in validate(loaded.config, loaded.dialect, world_flag=world_flag):  # raises ConfigError listing each error
        print(w, file=sys.stderr)
    return loaded.config


def _check_one_model(allocation) -> None:
    """`train` runs one model on the whole world: a config naming several (`models:`, an allocation
    mode with an inference engine beside the trainer) is refused before any rank starts, never
    trained in part."""
    from fivefold.errors import NotImplementedYet

    if allocation is None or len(allocation.components) == 1:
        return
    names = ", ".join(f"{c.name} ({c.role}) on GPUs {c.ranks[0]}-{c.ranks[-1]}" for c in allocation.components)
    raise NotImplementedYet(f"training several models in one world ({names}; RL post-training with actor / critic / "
                            "reference / rollout roles); `fivefold layout` shows each model's ranks, and `train` "
                            "runs one model: give its layout without `models:` / `allocation_mode`")


def prepare(config: Config, out: Path) -> Path:
    """Tokenize the corpus into OUT/data and fit the model's vocabulary to the tokenizer."""
    from fivefold.data.dataset import data_meta, prepare_data
    from fivefold.data.tokenizer import fitted_tokenizer

    tok, note = fitted_tokenizer(config)
    if note:
        print(f"note: {note}", file=sys.stderr)
    t = config.training
    mock = (0, 0)
    if config.data.mock_data:  # the (train, eval) tokens the run reads
        from fivefold.config.batch_sizes import BatchSizes

        window = (t.global_batch_size or t.micro_batch_size) * t.seq_length
        train_tokens = BatchSizes.of(t).start(t.train_iters) * t.seq_length if t.step_batch_size_schedule \
            else t.train_iters * window
        evaluates = t.eval_interval and t.eval_iters
        mock = (train_tokens + t.seq_length + 1, (t.eval_iters * window + t.seq_length + 1) if evaluates else 0)
    data_dir = prepare_data(config.data, tok, out / "data", t.seed, mock_tokens=mock, vocab_size=config.model.vocab_size)
    meta = data_meta(data_dir)
    if meta["kind"] in ("tokens", "indexed", "mock"):
        if meta.get("min_id", 0) < 0:  # (a signed .npy or int32 corpus: an embedding row that does not exist)
            raise UserError(f"{config.data.path}: holds token id {meta['min_id']}; token ids are >= 0 (check the file "
                            "and data.token_dtype)")
        if meta["max_id"] >= config.model.vocab_size:
            raise UserError(f"{config.data.path}: holds token id {meta['max_id']} >= model.vocab_size="
                            f"{config.model.vocab_size} (set model.vocab_size={meta['max_id'] + 1} or more)")
    elif config.checkpoint.load_hf:  # the model's vocabulary is the checkpoint's
        if tok.vocab_size > config.model.vocab_size:
            raise UserError(f"data.tokenizer has {tok.vocab_size} tokens, the model of checkpoint.load_hf "
                            f"{config.model.vocab_size}: set data.tokenizer to that model's tokenizer folder")
    elif config.model.vocab_size != tok.vocab_size:
        print(f"note: model.vocab_size set to {tok.vocab_size} from the tokenizer", file=sys.stderr)
        config.model.vocab_size = tok.vocab_size
    return data_dir


def run(args, extra: list[str]) -> int:
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and "FIVEFOLD_LAUNCHED" not in os.environ
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.nproc
    if under_torchrun and args.nproc not in (None, world):  # torchrun started the ranks: its count stands
        raise UserError(f"--nproc {args.nproc}: under torchrun the ranks are the ones it started (WORLD_SIZE="
                        f"{world}); drop --nproc, or give torchrun --nproc-per-node / --nnodes")
    if not under_torchrun or os.environ["RANK"] == "0":  # a running run's --out: refused before anything else
        refuse_if_held("--out", Path(args.out))
    from fivefold.config.supported import check_supported  # (imported after the check: it does not wait on them)
    from fivefold.launch import launch, place
    from fivefold.train.metrics import check_wandb
    from fivefold.watchdog import timeout_of

    path, words = split_config_arg(extra)
    if path is None and not words:
        raise UserError("train: give a CONFIG (YAML or .txt), or the run's Megatron flags / key=value words")
    world_flag = "torchrun's --nnodes x --nproc-per-node =" if under_torchrun else "--nproc" if world else None
    config = _load(path, words, world, args.trace_schedule, world_flag)
    check_supported(config)
    check_wandb(config.logging.wandb_project)
    timeout_s = timeout_of(config.training)
    nproc = config.cluster.resolved_world_size if world is None else world
    config.cluster.world_size = nproc
    _check_profile_ranks(config, nproc)
    c = config.checkpoint
    if c.load:  # a missing, damaged or incomplete checkpoint refused here, not on every rank once started
        from fivefold.checkpoint.io import check_resume, read_metadata
        from fivefold.train.loop import nothing_to_load
        if not nothing_to_load(c, warn=False):
            folder, meta = read_metadata(c.load)
            if not c.finetune:  # (--finetune reads the weights only: no step, no RNG state)
                check_resume(folder, meta, world_size=nproc, load_rng=c.load_rng)
    _refuse_a_checkpoint_root_in_use(config, Path(config.checkpoint.save or Path(args.out) / "checkpoints"))
    # written only once training runs (the first save, the first metric): a path that cannot be a folder is
    # refused now, not after the steps it would have kept; every one checked before the first is made, so
    # that a refused run leaves no folder behind
    folders = [("--out", args.out)]
    if config.checkpoint.save:
        folders.append(("checkpoint.save (--save)", config.checkpoint.save))
    if config.logging.tensorboard and config.logging.tensorboard_dir:
        folders.append(("logging.tensorboard_dir (--tensorboard-dir)", config.logging.tensorboard_dir))
    for flag, path in folders:
        check_output_folder(flag, path)
    if config.checkpoint.save_hf:  # written at the end: refused now, not after the run
        import torch

        from fivefold.hf.config import hf_config
        from fivefold.hf.export import check_replaceable
        check_replaceable(Path(config.checkpoint.save_hf), "checkpoint.save_hf (--save-hf)")
        hf_config(config.model, torch.float32)  # a model HF's config cannot say (NotImplementedYet)
    if under_torchrun:
        place(config, int(os.environ.get("LOCAL_WORLD_SIZE", nproc)), int(os.environ["RANK"]))
        out = _make_folders(config, folders)
        with holding("--out", out, "train") if os.environ["RANK"] == "0" else contextlib.nullcontext():
            return _run_under_torchrun(config, out)
    place(config, nproc)
    # the data is read (and refused: a missing file, a bad record, a token id past the vocabulary) into
    # OUT/data, so OUT is made first, and taken away again on a refusal when this run made it, as are
    # OUT/logs and OUT/data in an OUT that was there (not under torchrun, where every rank makes and fills
    # the folders at once)
    with contextlib.ExitStack() as lock:  # --out is this run's until the ranks end (fivefold.cli._lock)
        with removed_if_refused(*(path for _, path in folders), Path(args.out) / "logs", Path(args.out) / "data"):
            out = _make_folders(config, folders)
            lock.enter_context(holding("--out", out, "train"))
            data_dir = prepare(config, out)
            spec = out / "run.json"
            try:
                spec.write_text(json.dumps({"config": to_dict(config), "out": str(out), "data_dir": str(data_dir)},
                                           indent=1))
            except OSError as e:
                raise write_failed(spec, e, "the ranks' job description") from None
        print(f"fivefold train: {nproc} local ranks, output in {out}", file=sys.stderr)
        return launch(nproc, [str(spec)], out / "logs", timeout_s=timeout_s)


def _make_folders(config: Config, folders: list[tuple[str, str]]) -> Path:
    """Make the run's folders (--out first, which is returned) and OUT/logs."""
    out = [output_folder(flag, path) for flag, path in folders][0]
    (out / "logs").mkdir(exist_ok=True)
    _note_an_earlier_run(config, out)
    return out


def _check_profile_ranks(config: Config, world: int) -> None:
    """A profiled rank the run does not have would write no trace, silently: refused with the range."""
    lg = config.logging
    outside = [r for r in lg.profile_ranks if not 0 <= r < world] if lg.profile else []
    if outside:
        raise UserError(f"logging.profile_ranks (--profile-ranks) {lg.profile_ranks}: rank(s) "
                        f"{', '.join(map(str, outside))} not in this {world}-rank run; give ranks 0 to {world - 1} "
                        f"(e.g. --profile-ranks 0)")


def _refuse_a_checkpoint_root_in_use(config: Config, root: Path) -> None:
    """A run saves step_N folders into `root` and keeps the two newest there. One that does not resume
    from `root` (no --load, --load of another folder, --finetune or --load-hf: it counts from its own
    step) would overwrite the earlier run's checkpoints of the same step, and see its own deleted
    right after writing them when the earlier run's steps are higher; so, as there is no overwrite
    switch, it is refused before any rank starts, naming the ways on."""
    from fivefold.checkpoint.layout import complete_checkpoints, resolve

    saved = complete_checkpoints(root)
    if not saved:
        return
    c = config.checkpoint
    loaded = resolve(c.load) if c.load else None
    if loaded is not None and not c.finetune and loaded.parent.resolve() == root.resolve():
        return  # a resume: it continues the steps of `root`
    how = ("starts from step 0 (checkpoint.finetune)" if loaded is not None and c.finetune
           else f"loads {c.load}, not a checkpoint of that folder" if loaded is not None
           else "starts from step 0 (checkpoint.load_hf)" if c.load_hf else "does not load them (no --load)")
    elsewhere = "another checkpoint.save (--save)" if c.save else "another --out"
    raise UserError(f"checkpoint folder {root} holds an earlier run's checkpoints (up to {saved[-1].name}) and this "
                    f"run {how}: its saves would overwrite or rotate them out. Resume that run with --load {root}, "
                    f"give {elsewhere}, or remove {root} to start over")


def _note_an_earlier_run(config: Config, out: Path) -> None:
    """Say so when --out holds a run and this one does not load it: it starts at step 0 and replaces
    the folder's metrics.jsonl and pictures (as Megatron-LM, which saves beside the checkpoints there).
    Its checkpoints, if any, are not in the way: a run that would save over them was refused
    (`_refuse_a_checkpoint_root_in_use`)."""
    if config.checkpoint.load or config.checkpoint.load_hf or not (out / "metrics.jsonl").is_file():
        return
    if "RANK" in os.environ and os.environ["RANK"] != "0":
        return
    print(f"note: --out {out} holds an earlier run: this one starts at step 0 and replaces its metrics.jsonl",
          file=sys.stderr)


def _run_under_torchrun(config: Config, out: Path) -> int:
    """Every rank prepares the (deterministic) data into its own folder: no rank waits on another's files."""
    from fivefold.train.worker import run_rank

    rank = int(os.environ["RANK"])
    data_dir = prepare(config, out / f"rank-{rank}")
    return run_rank(config, out, data_dir)
