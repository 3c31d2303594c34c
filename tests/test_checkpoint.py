"""Checkpoint IO in one process: round trip, shape mismatch, a crash during a save, resharding."""
from __future__ import annotations

import json
import re
import os
import shutil

import pytest
import torch
from torch import nn

from fivefold.checkpoint import io
from fivefold.checkpoint.checksum import write_metadata
from fivefold.checkpoint.layout import ShardSpec, resolve
from fivefold.checkpoint.reshard import Reader, checkpoint_source, fill
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
    with Reader() as reader, torch.no_grad():
        assert fill(half.weight.data, shard_of("0.weight", half.weight), checkpoint_source(folder, meta)["0.weight"],
                    reader)
    assert torch.equal(half.weight, model[0].weight[4:])


@pytest.mark.parametrize("saved_pad,loaded_pad", [(512, 128), (128, 512)])
def test_vocabulary_padded_otherwise_loads(tmp_path, saved_pad, loaded_pad):
    """Megatron pads the vocabulary to make_vocab_size_divisible_by x TP, so a TP4 checkpoint holds
    512 embedding rows where a TP1 run of the same 256-token model has 256. The real rows (weights and
    AdamW moments) move across; padding rows are zero on both sides. Padding 512 vs 128 in one process
    stands for TP4 vs TP1."""
    from fivefold.config.schema import ModelConfig
    from fivefold.model import Decoder

    def model(pad, seed):
        cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=256,
                          make_vocab_size_divisible_by=pad)
        m = Decoder(cfg, seed=seed)
        opt = torch.optim.AdamW(m.parameters(), lr=0.1, foreach=False)
        ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(seed))
        m.loss(ids, ids)[0].backward()
        opt.step()
        return m, opt

    saved, saved_opt = model(saved_pad, seed=0)
    _save(tmp_path, 1, saved, saved_opt)
    loaded, loaded_opt = model(loaded_pad, seed=1)
    assert loaded.embedding.weight.shape[0] != saved.embedding.weight.shape[0]
    io.load_checkpoint(tmp_path, model=loaded, optimizer=loaded_opt, rank=0, world_size=1)
    for (name, a), (_, b) in zip(saved.named_parameters(), loaded.named_parameters()):
        rows = min(a.shape[0], b.shape[0])
        assert torch.equal(a[:rows], b[:rows]), name
        assert not b[rows:].any(), name  # padding beyond the checkpoint's rows: zero
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(saved_opt.state[a][m][:rows], loaded_opt.state[b][m][:rows]), (name, m)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(5))
    assert torch.equal(saved.loss(ids, ids)[0], loaded.loss(ids, ids)[0])


def test_other_vocabulary_is_still_another_model(tmp_path):
    from fivefold.config.schema import ModelConfig
    from fivefold.model import Decoder
    small = Decoder(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=200))
    _save(tmp_path, 1, small, torch.optim.AdamW(small.parameters()))
    big = Decoder(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=300,
                              make_vocab_size_divisible_by=256))  # 256 saved rows, 512 here
    with pytest.raises(UserError, match="another model"):  # real rows 256..299 are not in the checkpoint
        io.load_checkpoint(tmp_path, model=big, optimizer=None, rank=0, world_size=1)


@pytest.mark.parametrize("edit,said", [
    (lambda m: [1, 2], "holds a list, not an object"),
    (lambda m: {k: v for k, v in m.items() if k != "params"}, "has no 'params' key"),
    (lambda m: {k: v for k, v in m.items() if k != "step"}, "has no 'step' key"),
    (lambda m: {**m, "params": []}, r"'params' is \[\], not an object"),
    (lambda m: {**m, "step": "four"}, "'step' is 'four', not a whole number"),
    (lambda m: {**m, "data": {"consumed_samples": 8}}, r"'data' is \{'consumed_samples': 8\}, not an object with "
                                                       "'next_step'"),
    (lambda m: {**m, "data": {"next_step": -1}}, "'data.next_step' is -1, not a whole number"),
    (lambda m: {**m, "data": {"next_step": "6"}}, "'data.next_step' is '6', not a whole number"),
    (lambda m: {**m, "config": {"model": {"hidden_sise": 8}}}, "config.model has 'hidden_sise'"),
    (lambda m: {**m, "config": []}, "'config' is not an object of sections"),
    (lambda m: {**m, "params": {**m["params"], "0.bias": {**m["params"]["0.bias"], "global_shape": "8"}}},
     r"params\['0.bias'\] has 'global_shape' '8'"),
    (lambda m: {**m, "params": {"0.bias": {**m["params"]["0.bias"], "shards": [
        {**m["params"]["0.bias"]["shards"][0], "file": "../../elsewhere.safetensors"}]}}},
     r"params\['0.bias'\] shards\[0\] has 'file' '../../elsewhere.safetensors', not a file name"),
])
def test_damaged_metadata_is_named(tmp_path, edit, said):
    """A metadata.json that is valid JSON but not what a save writes was a KeyError / TypeError deep in
    train --load, convert or export: read_metadata, which they share, names the file, the key and the
    problem."""
    model, opt = _trained()
    _save(tmp_path, 1, model, opt)
    file = tmp_path / "step_00000001" / "metadata.json"
    write_metadata(file.parent, edit(json.loads(file.read_text())))  # edited with its checksum: a structure check
    with pytest.raises(UserError, match=f"{file}: {said}.*the checkpoint is damaged"):
        io.read_metadata(tmp_path)


def test_latest_naming_a_missing_step_is_refused(tmp_path):
    """--load ROOT whose `latest` names a deleted step loaded an older one without a word (training
    silently lost its steps): refused, naming both."""
    model, opt = _trained()
    for step in (1, 2):
        _save(tmp_path, step, model, opt)
    shutil.rmtree(tmp_path / "step_00000002")
    with pytest.raises(UserError, match=r"latest names 'step_00000002', which is not a complete checkpoint .*"
                                        r"the newest complete checkpoint there is step_00000001"):
        io.load_checkpoint(tmp_path, model=model, optimizer=opt, rank=0, world_size=1)
    (tmp_path / "latest").unlink()  # without `latest`: the newest complete one, as before
    assert io.read_metadata(tmp_path)[0] == tmp_path / "step_00000001"


def test_a_missing_rng_file_is_named(tmp_path):
    """A rank's rng-*.safetensors missing at the same world size was skipped: the run went on with
    other RNG streams than the checkpoint's. It is named as a missing shard is; --no-load-rng loads."""
    model, opt = _trained()
    _save(tmp_path, 1, model, opt)
    (tmp_path / "step_00000001" / "rng-00000.safetensors").unlink()
    with pytest.raises(UserError, match="rng-00000.safetensors is missing .*--no-load-rng"):
        io.load_checkpoint(tmp_path, model=model, optimizer=opt, rank=0, world_size=1)
    io.load_checkpoint(tmp_path, model=model, optimizer=opt, rank=0, world_size=1, load_rng=False)


def test_a_checkpoint_a_resume_cannot_continue_is_refused_before_loading(tmp_path):
    """`train --load` read data.next_step on every rank once started (a KeyError when absent) and found
    a missing rng-R.safetensors only when rank R loaded it. check_resume, run before any rank starts,
    names both; a checkpoint without a data position (saved by a script) stays readable (export, convert)."""
    model, opt = _trained()
    folder = _save(tmp_path, 1, model, opt)  # extra without "data": as a script calling save_checkpoint writes
    found, meta = io.read_metadata(tmp_path)
    with pytest.raises(UserError, match=rf"checkpoint {folder}: its metadata.json has no 'data.next_step' .*give "
                                        r"--finetune \(checkpoint.finetune=true\)"):
        io.check_resume(found, meta, world_size=1, load_rng=True)
    meta["data"] = {"next_step": 1}
    io.check_resume(found, meta, world_size=1, load_rng=True)
    (folder / "rng-00000.safetensors").unlink()
    with pytest.raises(UserError, match=rf"checkpoint {folder}: rng-00000.safetensors is missing \(rank 0's RNG "
                                        r"state; .*give --no-load-rng"):
        io.check_resume(found, meta, world_size=1, load_rng=True)
    io.check_resume(found, meta, world_size=1, load_rng=False)
    io.check_resume(found, meta, world_size=2, load_rng=True)  # another world size starts fresh streams anyway
    meta["world_size"] = 4
    with pytest.raises(UserError, match=r"rng-00000.safetensors, rng-00001.safetensors, rng-00002.safetensors and "
                                        r"1 more are missing \(the ranks' RNG states"):
        io.check_resume(found, meta, world_size=4, load_rng=True)


def test_rotation_never_deletes_the_checkpoint_it_just_wrote(tmp_path):
    """Rotation deleted all but the two highest step numbers: a save of step 1 into a root holding
    steps 2 and 4 (an earlier run's) deleted step 1 right after writing it, `latest` naming nothing.
    Steps above the one saved are another run's or branch's: left alone; the older ones rotate."""
    model, opt = _trained()
    for step in (2, 4):
        _save(tmp_path, step, model, opt)
    _save(tmp_path, 1, model, opt)
    assert resolve(tmp_path) == tmp_path / "step_00000001"
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000001", "step_00000002", "step_00000004"]
    _save(tmp_path, 3, model, opt)  # resumed from step 2: 1 rotates out, 4 (above) stays
    assert resolve(tmp_path) == tmp_path / "step_00000003"
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000002", "step_00000003", "step_00000004"]


@pytest.mark.parametrize("field, saved, here", [("qk_layernorm", True, False), ("add_qkv_bias", True, False),
                                                ("mtp_num_layers", 1, None), ("add_bias_linear", True, False)])
def test_a_checkpoint_with_parameters_this_model_lacks_is_another_model(field, saved, here, tmp_path):
    """A checkpoint saved with QK norms, QKV biases, linear biases or an MTP layer loaded into a model
    without them (every tensor this model holds was there, the extra ones dropped without a word): the
    fields that add parameters are compared with the run's model section; a field a checkpoint's config
    lacks (saved before it existed) holds its default."""
    from dataclasses import asdict

    from fivefold.config.schema import ModelConfig

    mine = asdict(ModelConfig())
    theirs = {**mine, field: saved}
    with pytest.raises(UserError, match=re.escape(f"model.{field} is {saved!r} in the checkpoint, {here!r} here")):
        io.check_fits({"params": {}, "config": {"model": theirs}}, {}, None, tmp_path, {**mine, field: here})
    old = {k: v for k, v in mine.items() if k != field}  # an older checkpoint's config without the field
    io.check_fits({"params": {}, "config": {"model": old}}, {}, None, tmp_path, mine)
