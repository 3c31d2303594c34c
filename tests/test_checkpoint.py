"""Checkpoint IO in one process: round trip, shape mismatch, a crash during a save, resharding."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from fivefold.checkpoint import io
from fivefold.checkpoint.layout import ShardSpec, resolve
from fivefold.errors import UserError


def _trained(width=8, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, width), nn.Linear(width, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def _save(root, step, model, opt, **kw):
    return io.save_checkpoint(root, step, model=model, optimizer=opt, rank=0, writes_params=True,
                              barrier=lambda: None, extra={"optimizer_step": step, "world_size": 1}, **kw)


def test_round_trip_restores_params_moments_and_rng(tmp_path):
    model, opt = _trained()
    torch.manual_seed(7)
    _save(tmp_path, 3, model, opt)
    expected_draw = torch.rand(3)
    fresh, fresh_opt = _trained(seed=1)
    io.load_checkpoint(tmp_path, model=fresh, optimizer=fresh_opt, rank=0, world_size=1)
    for (_, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b)
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[a][m], fresh_opt.state[b][m])
        assert float(fresh_opt.state[b]["step"]) == 3.0
    assert torch.equal(torch.rand(3), expected_draw)  # RNG continues where the save left it


def test_another_model_shape_is_a_user_error(tmp_path):
    model, opt = _trained(width=8)
    _save(tmp_path, 1, model, opt)
    other, other_opt = _trained(width=16)
    with pytest.raises(UserError, match=r"another model:\n  0.weight has shape \[8, 4\] in the checkpoint, \[16, 4\]"):
        io.load_checkpoint(tmp_path, model=other, optimizer=other_opt, rank=0, world_size=1)
    with pytest.raises(UserError, match="no complete checkpoint"):
        io.read_metadata(tmp_path / "nothing")


def test_crash_during_save_leaves_previous_checkpoint_latest(tmp_path, monkeypatch):
    model, opt = _trained()
    first = _save(tmp_path, 1, model, opt)
    real_rename = os.rename

    def killed(*a):  # the process dies after writing every file, before the commit rename
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(os, "rename", killed)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2, model, opt)
    monkeypatch.setattr(os, "rename", real_rename)
    assert (tmp_path / ".tmp-step_00000002").is_dir()
    assert resolve(tmp_path) == first
    for step in (2, 3, 4):
        _save(tmp_path, step, model, opt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000003", "step_00000004"]


def test_load_into_another_sharding(tmp_path):
    model, opt = _trained()
    _save(tmp_path, 1, model, opt)
    half = nn.Linear(4, 4)  # rows 4..7 of layer 0's weight and bias, as a TP shard would hold

    class Shard(nn.Module):
        def __init__(self):
            super().__init__()
            self.add_module("0", half)

    shard = Shard()

    def shard_of(name, t):
        return ShardSpec((8, 4) if t.ndim == 2 else (8,), (4, 0) if t.ndim == 2 else (4,))

    folder, meta = io.read_metadata(tmp_path)
    meta["params"] = {k: v for k, v in meta["params"].items() if k.startswith("0.")}
    io.check_fits(meta, shard, shard_of, folder)
    with torch.no_grad():
        assert io._assemble(folder, meta["params"]["0.weight"], "0.weight", half.weight.data,
                            shard_of("0.weight", half.weight))
    assert torch.equal(half.weight, model[0].weight[4:])
