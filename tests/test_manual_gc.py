"""Megatron's --manual-gc (fivefold.train.manual_gc): the collector off during training, collections where
Megatron makes them, the same losses."""
from __future__ import annotations

import gc

import pytest

from _train_util import corpus, one_process_context, tiny_config
from fivefold.cli.train import prepare
from fivefold.config.load import load_config
from fivefold.config.validate import ConfigError, validate
from fivefold.train import loop


@pytest.mark.parametrize("words", [
    ["--manual-gc", "--manual-gc-interval", "100", "--no-manual-gc-eval"],
    ["cfg.train.manual_gc=true", "cfg.train.manual_gc_interval=100", "cfg.train.manual_gc_eval=false"],
])
def test_manual_gc_is_read_in_megatron_and_bridge_words(words):
    t = load_config(None, words).config.training
    assert (t.manual_gc, t.manual_gc_interval, t.manual_gc_eval) == (True, 100, False)
    assert load_config(None, ["cfg.train.manual_gc_eval=100"]).config.training.manual_gc_eval is True  # Bridge's recipes
    bad = load_config(None, ["--manual-gc", "--manual-gc-interval", "-1"]).config
    with pytest.raises(ConfigError, match="manual_gc_interval=-1: must be a whole number >= 0"):
        validate(bad)


def test_manual_gc_collects_where_megatron_does_and_trains_the_same(tmp_path, monkeypatch):
    """4 steps, --manual-gc-interval 2, an evaluation every 2 steps: a full collection at the start; at
    steps 2 and 4 a full one before the evaluation, a young-generation one after it, a full one after
    the step (Megatron's order); the collector off during every step and on again after training; the
    losses bit for bit those of a run without it."""
    cfg = tiny_config(corpus(tmp_path / "corpus"), steps=4, eval_interval=2)
    data_dir = prepare(cfg, tmp_path)
    (tmp_path / "plain").mkdir(), (tmp_path / "manual").mkdir()
    plain = loop.train(cfg, one_process_context(tmp_path / "plain"), data_dir, progress=False)
    collected, enabled = [], []
    real_step = loop._step
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation) or 0)
    monkeypatch.setattr(loop, "_step", lambda *a: enabled.append(gc.isenabled()) or real_step(*a))
    cfg.training.manual_gc, cfg.training.manual_gc_interval = True, 2
    assert gc.isenabled()
    manual = loop.train(cfg, one_process_context(tmp_path / "manual"), data_dir, progress=False)
    assert collected == [2, 2, 0, 2, 2, 0, 2], collected
    assert enabled == [False] * 4 and gc.isenabled()
    assert manual.losses == plain.losses and manual.eval_losses == plain.eval_losses
