"""Megatron's default loss (no --calculate-per-token-loss): the mean over the global batch's
microbatches of each one's per-token mean — not the per-token mean over the whole batch, from which it
differs when microbatches hold different numbers of target tokens (here: --eod-mask-loss drops each
microbatch's end-of-document targets). Checked against the formula on the model itself, and every
layout (DP, PP with its per-microbatch loss scales) equal to the one-process run."""
from __future__ import annotations

import pytest
import torch

from _tol import close
from _train_util import one_process_context, tiny_config
from fivefold.cli.train import prepare
from fivefold.config.schema import to_dict
from fivefold.config.validate import layout_of
from fivefold.model import build_decoder
from fivefold.runtime.mesh import Mesh
from fivefold.train.loop import _loaders, train
import test_zero


def _config(data, per_token: bool):
    cfg = tiny_config(data, gbs=4, mbs=1, steps=3)
    cfg.data.eod_mask_loss = True
    cfg.training.calculate_per_token_loss = per_token
    return cfg


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_loss")
    data = root / "corpus"  # short documents: each 33-token window holds a different number of EODs
    data.mkdir()
    for i in range(60):
        (data / f"doc{i:02d}.txt").write_text(f"x = {i}" + " + 1" * (i % 5))
    return root, data, prepare(_config(data, False), root)


def test_step_loss_is_the_mean_of_microbatch_means(setup):
    root, data, data_dir = setup
    runs = {}
    for per_token in (False, True):
        (root / f"one-{per_token}").mkdir(exist_ok=True)
        runs[per_token] = train(_config(data, per_token), one_process_context(root / f"one-{per_token}"), data_dir,
                                progress=False)
    cfg = _config(data, False)
    ctx = one_process_context(root / "formula")
    batch = _loaders(cfg, ctx, data_dir)[0].step_batch(0)
    model = build_decoder(cfg, Mesh.build(layout_of(cfg)))  # the run's initial weights (same seed)
    with torch.no_grad():
        means = [float(model.loss(mb.input_ids, mb.labels)[0]) / mb.num_tokens for mb in batch.microbatches]
    assert len({mb.num_tokens for mb in batch.microbatches}) > 1  # the EOD targets differ per microbatch
    close(runs[False].losses[0], sum(means) / len(means), rtol=1e-6, site="megatron_loss.formula")
    assert abs(runs[False].losses[0] - runs[True].losses[0]) > 1e-4  # the two definitions do differ here


@pytest.mark.parametrize("name, world, parallel", [("dp2", 2, {}), ("pp2-dp2", 4, {"pipeline_model_parallel_size": 2})])
def test_layouts_equal_one_process(setup, workers, name, world, parallel):
    """Measured worst 5.1e-8 relative; bound 1e-6 (19x)."""
    root, data, data_dir = setup
    cfg = _config(data, False)
    (root / "ref").mkdir(exist_ok=True)
    ref = train(cfg, one_process_context(root / "ref"), data_dir, progress=False)
    cfg.cluster.world_size = world
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    got = workers(world).run(test_zero._train_rank, to_dict(cfg), str(root / name), str(data_dir))[0]["losses"]
    for step, loss in ref.losses.items():
        close(got[step], loss, rtol=1e-6, site="megatron_loss.layouts", case=f"{name} step {step}")
