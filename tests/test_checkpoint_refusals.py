"""--load refuses, with the way forward, what it must not or cannot read: pickled folders, DCP /
Megatron torch_dist checkpoints, a Hugging Face folder, a checkpoint missing a shard file or holding
a truncated one."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn

from fivefold.checkpoint import io
from fivefold.errors import UserError


def _saved(root):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    folder = io.save_checkpoint(root, 1, model=model, optimizer=opt, rank=0, writes_params=True, barrier=lambda: None,
                                extra={"optimizer_step": 1, "world_size": 1})
    return model, opt, folder


def _load(path, model, opt):
    return io.load_checkpoint(path, model=model, optimizer=opt, rank=0, world_size=1)


def test_pickled_folders_are_refused_by_name(tmp_path):
    model, opt, _ = _saved(tmp_path / "ok")
    hf = tmp_path / "hf"
    hf.mkdir()
    torch.save(model.state_dict(), hf / "pytorch_model.bin")
    with pytest.raises(UserError, match=r"only pickled files \(pytorch_model.bin, ...\): fivefold does not unpickle"):
        _load(hf, model, opt)
    legacy = tmp_path / "megatron" / "iter_0000010" / "mp_rank_00"  # Megatron's legacy torch format
    legacy.mkdir(parents=True)
    torch.save({"model": model.state_dict()}, legacy / "model_optim_rng.pt")
    (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").write_text("10")
    with pytest.raises(UserError, match="iter_0000010/mp_rank_00/model_optim_rng.pt.*Megatron-Bridge"):
        _load(tmp_path / "megatron", model, opt)


def test_dcp_checkpoint_is_refused_with_the_way_through_hf(tmp_path):
    model, opt, _ = _saved(tmp_path / "ok")
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp" / "iter_0000010"))
    with pytest.raises(UserError, match=r"DCP / Megatron torch_dist\) checkpoint. Its .metadata file is a pickle.*"
                                        "Hugging Face safetensors folder"):
        _load(tmp_path / "dcp", model, opt)


def test_hf_folder_is_pointed_to_the_importer(tmp_path):
    model, opt, _ = _saved(tmp_path / "ok")
    (tmp_path / "hf").mkdir()
    save_file({"w": torch.zeros(2)}, str(tmp_path / "hf" / "model.safetensors"))
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(UserError, match="a Hugging Face model folder, not a fivefold checkpoint"):
        _load(tmp_path / "hf", model, opt)


def test_missing_shard_file_is_named(tmp_path):
    model, opt, folder = _saved(tmp_path)
    os.remove(folder / "optim-00000.safetensors")
    with pytest.raises(UserError, match="is missing optim-00000.safetensors .*load an earlier checkpoint"):
        _load(tmp_path, model, opt)


@pytest.mark.parametrize("cut", [1, 100, 10_000])
def test_truncated_safetensors_is_refused_before_use(tmp_path, cut):
    model, opt, folder = _saved(tmp_path)
    shard = folder / "model-00000.safetensors"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(max(0, size - cut))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UserError, match=r"model-00000.safetensors is truncated or damaged \("):
        _load(tmp_path, model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing half-loaded
