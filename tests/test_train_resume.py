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
