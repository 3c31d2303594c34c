"""`fivefold convert SRC DST [layout flags]`: a one-process checkpoint rewritten as TP2 x PP2 ranks
write it (each file holds only its rank's shards), which loads back bit-exactly and resumes on the
uninterrupted losses; a layout that changes the model is refused."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from _train_util import corpus, one_process_context, tiny_config
from fivefold.checkpoint import io
from fivefold.checkpoint.checksum import write_metadata
from fivefold.checkpoint.convert import write_streaming
from fivefold.cli import main
from fivefold.cli.train import prepare
from fivefold.model import Decoder
from fivefold.train.loop import train
from test_moe import _one_thread


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    cfg = tiny_config(corpus(root / "corpus"), steps=4)
    cfg.checkpoint.save_interval = 2
    data_dir = prepare(cfg, root)
    (root / "full").mkdir()
    with _one_thread():
        full = train(cfg, one_process_context(root / "full"), data_dir, progress=False)
    return root, cfg, data_dir, full


def test_convert_to_tp2_pp2_round_trips_and_resumes(saved, tmp_path):
    root, cfg, data_dir, full = saved
    src = root / "full" / "checkpoints" / "step_00000002"
    dst = tmp_path / "tp2pp2"
    assert main(["convert", str(src), str(dst), "--tensor-model-parallel-size", "2",
                 "--pipeline-model-parallel-size", "2", "--world-size", "4"]) == 0
    meta = json.loads((dst / "step_00000002" / "metadata.json").read_text())
    assert meta["world_size"] == 4 and meta["config"]["parallel"]["tensor_model_parallel_size"] == 2
    # no RNG stream at another world size, and the metadata says so: `train --load` in that layout (4 ranks)
    # was refused for a missing rng-00000.safetensors, as if the checkpoint were incomplete
    assert meta["rng_saved"] is False and not list((dst / "step_00000002").glob("rng-*"))
    io.check_resume(dst / "step_00000002", meta, world_size=4, load_rng=True)
    qkv = meta["params"]["layers.0.attn.q_proj.weight"]["shards"]
    assert sorted(s["file"] for s in qkv) == ["model-00000.safetensors", "model-00001.safetensors"]  # stage 0, TP2
    with safe_open(str(dst / "step_00000002" / "model-00002.safetensors"), framework="pt") as f:
        assert not any(k.startswith("layers.0.") for k in f.keys())  # stage 1 holds layer 1 only
    mine, theirs = Decoder(cfg.model), Decoder(cfg.model)
    opt_a = torch.optim.AdamW(mine.parameters())
    opt_b = torch.optim.AdamW(theirs.parameters())
    io.load_checkpoint(dst, model=mine, optimizer=opt_a, rank=0, world_size=1)
    io.load_checkpoint(src, model=theirs, optimizer=opt_b, rank=0, world_size=1)
    for (n, a), b in zip(mine.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b), n
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt_a.state[a][m], opt_b.state[b][m]), (n, m)
    cfg.checkpoint.load = str(dst)
    (tmp_path / "resumed").mkdir()
    with _one_thread():
        resumed = train(cfg, one_process_context(tmp_path / "resumed"), data_dir, progress=False)
    assert resumed.losses == {s: full.losses[s] for s in (2, 3)}  # bit-exact: the same values


def test_convert_refuses_another_model(saved, tmp_path, capsys):
    root = saved[0]
    assert main(["convert", str(root / "full" / "checkpoints"), str(tmp_path / "x"), "--num-layers", "3"]) == 2
    assert "was saved from another model:\n  model.num_layers is 2 in the checkpoint, 3 here" in capsys.readouterr().err

def test_streaming_writer_matches_safetensors(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.bfloat16), "c": torch.zeros(0)}
    write_streaming(tmp_path / "s.safetensors", [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()],
                    lambda k: tensors[k])
    with safe_open(str(tmp_path / "s.safetensors"), framework="pt") as f:
        for k, v in tensors.items():
            assert torch.equal(f.get_tensor(k), v)


def test_convert_refuses_a_step_folder_as_destination(saved, capsys):
    """DST is a root (step_N and `latest` go into it): a checkpoint's own step folder is refused,
    left as it was."""
    step = saved[0] / "full" / "checkpoints" / "step_00000002"
    before = sorted(p.name for p in step.iterdir())
    assert main(["convert", str(step), str(step), "--tensor-model-parallel-size", "2", "--world-size", "2"]) == 2
    assert "is a checkpoint's step folder" in capsys.readouterr().err
    assert sorted(p.name for p in step.iterdir()) == before


def test_a_run_loaded_at_its_last_step_trains_nothing_and_says_so(saved, tmp_path):
    """--load of the step train_iters already reaches: no step runs (as in Megatron), and the result
    carries the step it started from, which the summary names instead of a throughput of 0."""
    root, cfg, data_dir, full = saved
    cfg = tiny_config(cfg.data.path, steps=4)
    cfg.checkpoint.load = str(root / "full" / "checkpoints")  # its latest: step 4
    (tmp_path / "again").mkdir()
    with _one_thread():
        again = train(cfg, one_process_context(tmp_path / "again"), data_dir, progress=False)
    assert (again.losses, again.start_step) == ({}, 4)


def test_convert_of_an_older_step_leaves_latest_at_the_newer_one(saved, tmp_path, capsys):
    """Converting step 2 into a root that holds step 4 moved its `latest` back to step 2: a later
    --load DST silently lost two steps. `latest` stays at the newer step, with a note."""
    ckpts = saved[0] / "full" / "checkpoints"
    dst = tmp_path / "dst"
    assert main(["convert", str(ckpts / "step_00000004"), str(dst)]) == 0
    assert main(["convert", str(ckpts / "step_00000002"), str(dst)]) == 0
    assert f"{dst} holds step_00000004, newer than the converted step_00000002" in capsys.readouterr().out
    assert (dst / "latest").read_text() == "step_00000004"
    assert sorted(p.name for p in dst.iterdir()) == ["latest", "step_00000002", "step_00000004"]


def test_convert_refuses_words_that_change_more_than_the_layout(saved, tmp_path, capsys):
    """The words after DST change the layout; run settings were stored silently into the new
    checkpoint's config (its help says the model and run settings are the checkpoint's)."""
    src = saved[0] / "full" / "checkpoints"
    assert main(["convert", str(src), str(tmp_path / "x"), "--tensor-model-parallel-size", "2", "--world-size", "2",
                 "training.lr=0.5", "training.train_iters=99", "data.max_documents=3"]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in ("training.lr=0.5", "training.train_iters=99", "data.max_documents=3",
                                  "change only the layout"))
    assert not (tmp_path / "x").exists()
    gbs = io.read_metadata(src)[1]["config"]["training"]["global_batch_size"]  # what a new DP size may need
    assert main(["convert", str(src), str(tmp_path / "y"), f"training.global_batch_size={2 * gbs}"]) == 0


def test_convert_refuses_a_checkpoint_without_a_rank_file_or_config(saved, tmp_path, capsys):
    """A missing rng-*.safetensors was skipped (the copy lacked it too, and --load of it would then
    refuse); a metadata.json without config was a KeyError. Both are named, DST left without the step."""
    src = tmp_path / "src"
    shutil.copytree(saved[0] / "full" / "checkpoints" / "step_00000004", src)
    (src / "rng-00000.safetensors").unlink()
    assert main(["convert", str(src), str(tmp_path / "dst")]) == 2
    assert "rng-00000.safetensors is missing" in capsys.readouterr().err
    meta = json.loads((src / "metadata.json").read_text())
    del meta["config"]
    write_metadata(src, meta)
    assert main(["convert", str(src), str(tmp_path / "dst")]) == 2
    assert "its metadata.json has no config" in capsys.readouterr().err
    assert not (tmp_path / "dst").exists()


def test_a_refused_convert_leaves_no_destination_folder(saved, tmp_path, capsys):
    """DST was made before convert's own checks (a missing RNG file, a model that does not fit the
    checkpoint): a refusal left an empty DST (and the folders above it) behind. Now taken away again
    when this command made them; a DST that was there stays."""
    src = tmp_path / "src"
    shutil.copytree(saved[0] / "full" / "checkpoints" / "step_00000004", src)
    dst = tmp_path / "new" / "dst"
    assert main(["convert", str(src), str(dst), "--num-layers", "3"]) == 2
    assert "was saved from another model" in capsys.readouterr().err
    (src / "rng-00000.safetensors").unlink()
    assert main(["convert", str(src), str(dst)]) == 2
    assert "rng-00000.safetensors is missing" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    dst.mkdir(parents=True)
    assert main(["convert", str(src), str(dst)]) == 2
    assert dst.is_dir() and not list(dst.iterdir())
