"""Resuming from a checkpoint gives exactly the losses of an uninterrupted run (fp32, CPU)."""
from __future__ import annotations

import json

from _train_util import corpus, one_process_context, tiny_config
from fivefold.checkpoint.layout import resolve
from fivefold.cli.train import prepare
from fivefold.train.loop import train


def test_resume_reproduces_uninterrupted_losses_exactly(tmp_path):
    cfg = tiny_config(corpus(tmp_path / "corpus"), steps=6, eval_interval=2)
    cfg.checkpoint.save_interval = 2
    data_dir = prepare(cfg, tmp_path)
    full_out, part_out = tmp_path / "full", tmp_path / "part"
    full_out.mkdir(), part_out.mkdir()
    full = train(cfg, one_process_context(full_out), data_dir, progress=False)
    cfg.checkpoint.load = str(full_out / "checkpoints" / "step_00000004")
    resumed = train(cfg, one_process_context(part_out), data_dir, progress=False)
    assert list(resumed.losses) == [4, 5]
    for step, loss in resumed.losses.items():
        assert loss == full.losses[step]  # bit-exact: same params, moments, LR and data at each step
    assert resumed.eval_losses[5] == full.eval_losses[5]
    assert resolve(full_out / "checkpoints").name == "step_00000006"  # the two newest are kept: 4 and 6
    meta = json.loads((full_out / "checkpoints" / "step_00000006" / "metadata.json").read_text())
    assert meta["data"] == {"next_step": 6, "consumed_samples": 48}
    assert meta["params"]["embedding.weight"]["global_shape"] == [256, 32]
    assert (full_out / "loss.png").stat().st_size > 0


def test_no_load_optim_resumes_the_weights_with_a_fresh_optimizer(tmp_path):
    """Megatron's --no-load-optim: the weights and the step come back, AdamW's moments do not. The first
    resumed loss (before any update) equals the uninterrupted run's; the next differs, as a fresh AdamW's
    first update (about lr x sign(g)) is not the resumed one's."""
    from fivefold.config.load import load_config

    flags = load_config(None, ["--no-load-optim", "--no-load-rng"]).config.checkpoint
    assert (flags.load_optim, flags.load_rng) == (False, False)
    cfg = tiny_config(corpus(tmp_path / "corpus"), steps=6)
    cfg.checkpoint.save_interval = 4
    data_dir = prepare(cfg, tmp_path)
    full_out, part_out = tmp_path / "full", tmp_path / "part"
    full_out.mkdir(), part_out.mkdir()
    full = train(cfg, one_process_context(full_out), data_dir, progress=False)
    cfg.checkpoint.load, cfg.checkpoint.load_optim = str(full_out / "checkpoints" / "step_00000004"), False
    resumed = train(cfg, one_process_context(part_out), data_dir, progress=False)
    assert list(resumed.losses) == [4, 5] and resumed.losses[4] == full.losses[4]
    assert abs(resumed.losses[5] - full.losses[5]) > 1e-6, (resumed.losses, full.losses)


def test_exit_interval_and_duration_stop_after_a_checkpoint_and_finetune_restarts_at_step_0(tmp_path):
    """Megatron's --exit-interval 2 stops after step 2 with a checkpoint there, and the same command
    resumes and stops at 4; --exit-duration-in-mins 0 stops after the first step. --finetune loads the
    weights only: it starts at step 0 with a fresh optimizer, on the trained weights (a lower loss
    than the untrained model's on the same first batch)."""
    cfg = tiny_config(corpus(tmp_path / "corpus"), steps=6)
    data_dir = prepare(cfg, tmp_path)
    cfg.training.exit_interval = 2
    cfg.checkpoint.save = str(tmp_path / "ckpt")
    first = train(cfg, one_process_context(_out(tmp_path, "a")), data_dir, progress=False)
    assert list(first.losses) == [0, 1] and first.checkpoint.name == "step_00000002"
    cfg.checkpoint.load = cfg.checkpoint.save
    second = train(cfg, one_process_context(_out(tmp_path, "b")), data_dir, progress=False)
    assert list(second.losses) == [2, 3] and second.checkpoint.name == "step_00000004"
    cfg.training.exit_interval, cfg.training.exit_duration_in_mins = None, 0.0
    cfg.checkpoint.load = cfg.checkpoint.save = None
    once = train(cfg, one_process_context(_out(tmp_path, "c")), data_dir, progress=False)
    assert list(once.losses) == [0]
    cfg.training.exit_duration_in_mins, cfg.training.exit_interval = None, 1
    cfg.checkpoint.load, cfg.checkpoint.finetune = str(tmp_path / "ckpt"), True
    tuned = train(cfg, one_process_context(_out(tmp_path, "d")), data_dir, progress=False)
    assert list(tuned.losses) == [0] and tuned.losses[0] < once.losses[0] - 0.05, (tuned.losses, once.losses)


def _out(root, name):
    (root / name).mkdir()
    return root / name
