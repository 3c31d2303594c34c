"""`fivefold train` through the CLI: user mistakes end with a clear message, exit 2, no traceback."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fivefold.checkpoint.checksum import write_metadata
from fivefold.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def _train(tmp_path, config_text: str, *words: str, nproc: int = 1) -> subprocess.CompletedProcess:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(config_text)
    return subprocess.run([sys.executable, "-m", "fivefold", "train", str(cfg), *words, "--out", str(tmp_path / "out"),
                           "--nproc", str(nproc)], cwd=REPO, capture_output=True, text=True, timeout=120)


TINY = """
model: {num_layers: 1, hidden_size: 32, num_attention_heads: 2}
training: {seq_length: 16, global_batch_size: 2, micro_batch_size: 1, train_iters: 2}
"""


def _refused(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in r.stderr, r.stderr


def test_missing_data_path(tmp_path):
    _refused(_train(tmp_path, TINY, f"data.path={tmp_path}/nope.txt"), "no such file", "nope.txt")


def test_malformed_jsonl_line(tmp_path):
    bad = tmp_path / "d.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "broken"\n')
    _refused(_train(tmp_path, TINY, f"data.path={bad}"), "d.jsonl:2: malformed JSON")


def test_unknown_override_key(tmp_path):
    r = _train(tmp_path, TINY, "training.learning_rat=0.1")
    _refused(r, "learning_rat")


@pytest.mark.parametrize("words,needle", [
    (["--optimizer", "sgd"], "optimizers other than adamw"),
    (["--num-experts", "4", "--moe-router-load-balancing-type", "sinkhorn"], "sinkhorn load balancing"),
    (["--recompute-granularity", "selective", "--recompute-modules", "mlp"], "selective recompute of modules other"),
])
def test_not_implemented_knob(tmp_path, words, needle):
    _refused(_train(tmp_path, TINY, *words, nproc=2), needle, "not implemented yet")


def test_checkpoint_of_another_model_shape(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello world, " * 400)
    ok = _train(tmp_path, TINY, f"data.path={text}")
    assert ok.returncode == 0, ok.stderr
    r = _train(tmp_path, TINY, f"data.path={text}", "model.hidden_size=64",
               f"checkpoint.load={tmp_path}/out/checkpoints")
    _refused(r, "saved from another model", "in the checkpoint", "loading and `convert` change the layout, never the model")


def test_load_of_a_folder_without_a_checkpoint_as_each_dialect_has_it(tmp_path):
    """fivefold's own config: --load naming no checkpoint is refused before any rank starts (it was
    refused by every rank once started). A Megatron command line (its scripts pass the save folder as
    --load): a warning and step 0, as Megatron-LM without --exit-on-missing-checkpoint, which refuses."""
    missing = tmp_path / "ckpt"
    _refused(_train(tmp_path, TINY, f"checkpoint.load={missing}"), f"--load {missing}: no complete checkpoint")
    assert not (tmp_path / "out").exists()  # no rank started, no run folder made
    megatron = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
                "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
                "--train-iters", "2", "--lr", "1e-3", "--save", str(missing), "--load", str(missing)]
    run = [sys.executable, "-m", "fivefold", "train", *megatron, "--out", str(tmp_path / "m"), "--nproc", "1"]
    _refused(subprocess.run(run + ["--exit-on-missing-checkpoint"], cwd=REPO, capture_output=True, text=True,
                            timeout=120), f"--load {missing}: no complete checkpoint")
    r = subprocess.run(run, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"--load {missing}: no checkpoint there yet; training starts from step 0" in r.stderr
    assert (missing / "latest").exists() or any(missing.glob("step_*"))


def test_nproc_under_torchrun_is_refused_unless_it_is_torchruns_count(tmp_path, monkeypatch, capsys):
    """Under torchrun the ranks are the ones it started: a --nproc beside it that differs was ignored;
    it is refused naming torchrun's count and flags (the one it equals stays accepted)."""
    from fivefold.cli import main
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("FIVEFOLD_LAUNCHED", raising=False)
    assert main(["train", "examples/demo.yaml", "--out", str(tmp_path / "out"), "--nproc", "4"]) == 2
    assert "--nproc 4: under torchrun the ranks are the ones it started (WORLD_SIZE=2)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_run_into_an_earlier_runs_folder_says_what_it_replaces(tmp_path, capsys, monkeypatch):
    """--out holding a run, no --load: the run starts over and replaces metrics.jsonl (silently before);
    the note says so. Nothing said for a fresh folder or a run that loads."""
    from fivefold.cli.train import _note_an_earlier_run
    from fivefold.config.schema import Config

    monkeypatch.delenv("RANK", raising=False)
    out = tmp_path / "out"
    out.mkdir()
    _note_an_earlier_run(Config(), out)
    assert capsys.readouterr().err == ""  # no metrics.jsonl: not a run
    (out / "metrics.jsonl").write_text('{"step": 0, "loss": 5.0}\n')
    _note_an_earlier_run(Config(), out)
    assert "holds an earlier run: this one starts at step 0 and replaces its metrics.jsonl" in capsys.readouterr().err
    resumed = Config()
    resumed.checkpoint.load = str(out / "checkpoints")
    _note_an_earlier_run(resumed, out)
    assert capsys.readouterr().err == ""

def test_a_checkpoint_that_cannot_be_resumed_is_refused_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    """--load of a checkpoint without data.next_step was a KeyError on every rank; one missing a rank's
    rng-R.safetensors was found by that rank once all had started. Both are refused before the ranks
    start, naming the way on (--finetune; --no-load-rng), which then passes the check."""
    import torch

    from fivefold.checkpoint.io import save_checkpoint
    from fivefold.cli import main

    started = []
    monkeypatch.setattr("fivefold.launch.launch", lambda *a, **kw: started.append(a) or 0)
    cfg, text = tmp_path / "c.yaml", tmp_path / "t.txt"
    cfg.write_text(TINY)
    text.write_text("hello world, " * 40)
    model = torch.nn.Linear(2, 2)
    root = tmp_path / "ckpt"
    folder = save_checkpoint(root, 1, model=model, optimizer=torch.optim.AdamW(model.parameters()), rank=0,
                             writes_params=True, barrier=lambda: None, extra={"world_size": 1})
    train = ["train", str(cfg), f"data.path={text}", f"checkpoint.load={root}", "--nproc", "1"]
    assert main([*train, "--out", str(tmp_path / "a")]) == 2
    assert f"checkpoint {folder}: its metadata.json has no 'data.next_step'" in capsys.readouterr().err
    meta = json.loads((folder / "metadata.json").read_text())
    write_metadata(folder, {**meta, "data": {"next_step": 1}})
    (folder / "rng-00000.safetensors").unlink()
    assert main([*train, "--out", str(tmp_path / "b")]) == 2
    assert f"checkpoint {folder}: rng-00000.safetensors is missing" in capsys.readouterr().err
    assert not started and not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert main([*train, "--no-load-rng", "--out", str(tmp_path / "c")]) == 0  # then the ranks start
    assert len(started) == 1


def _fake_checkpoint(root: Path, step: int) -> Path:
    """A folder `complete_checkpoints` counts (what the refusal reads), without training a run."""
    folder = root / f"step_{step:08d}"
    folder.mkdir(parents=True)
    (folder / "metadata.json").write_text("{}")
    (root / "latest").write_text(folder.name)
    return folder


def test_a_run_that_would_save_over_an_earlier_runs_checkpoints_is_refused(tmp_path):
    """A rerun into an --out holding checkpoints, without --load, wrote its own steps beside them: the
    same step overwritten, its lower ones rotated out right after writing (`latest` naming a deleted
    folder). Refused before any rank starts, naming the folder and the ways on; nothing is touched."""
    root = tmp_path / "out" / "checkpoints"
    old = _fake_checkpoint(root, 4)
    _refused(_train(tmp_path, TINY), f"checkpoint folder {root} holds an earlier run's checkpoints (up to step_00000004)",
             f"--load {root}", "another --out", f"remove {root}")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000004"]
    assert (old / "metadata.json").read_text() == "{}"
    assert not (tmp_path / "out" / "logs").exists()  # refused before the run's folder was set up


def test_which_runs_may_save_into_a_checkpoint_folder(tmp_path):
    """A resume from the folder itself (its root or one of its steps) saves there; a fresh start, a
    --finetune of it, a --load-hf or a --load of another folder would save over its steps."""
    from fivefold.cli.train import _refuse_a_checkpoint_root_in_use
    from fivefold.config.schema import Config

    root, other = tmp_path / "ckpt", tmp_path / "other"
    _refuse_a_checkpoint_root_in_use(Config(), root)  # nothing there yet
    _fake_checkpoint(root, 4)
    _fake_checkpoint(other, 2)
    for load in (root, root / "step_00000004"):
        resume = Config()
        resume.checkpoint.load = str(load)
        _refuse_a_checkpoint_root_in_use(resume, root)
    for field, value, said in (("load", None, "does not load them (no --load)"),
                               ("load", str(other), f"loads {other}, not a checkpoint of that folder"),
                               ("load_hf", str(other), "checkpoint.load_hf"),
                               ("finetune", True, "checkpoint.finetune")):
        c = Config()
        c.checkpoint.load = str(root) if field == "finetune" else None
        setattr(c.checkpoint, field, value)
        with pytest.raises(UserError, match=re.escape(said)):
            _refuse_a_checkpoint_root_in_use(c, root)
    explicit = Config()
    explicit.checkpoint.save = str(root)
    with pytest.raises(UserError, match=r"another checkpoint.save \(--save\)"):
        _refuse_a_checkpoint_root_in_use(explicit, root)


@pytest.mark.parametrize("key,flag", [("checkpoint.save", "checkpoint.save (--save)"),
                                      ("logging.tensorboard_dir", "logging.tensorboard_dir (--tensorboard-dir)")])
def test_an_output_path_that_cannot_be_a_folder_is_refused_before_training(tmp_path, key, flag):
    """checkpoint.save and logging.tensorboard_dir were first written after training had run (the
    first save: the steps lost; TensorBoard's writer on rank 0: a traceback, exit 1): a file in the
    way is refused before any rank starts, as --out is."""
    blocker = tmp_path / "afile"
    blocker.write_text("mine")
    _refused(_train(tmp_path, TINY, f"{key}={blocker}"), f"{flag} {blocker}: a file is there, not a folder")
    assert blocker.read_text() == "mine"
    assert not (tmp_path / "out" / "logs").exists()


def test_a_refused_run_leaves_no_folder_behind(tmp_path, monkeypatch, capsys):
    """--out (and checkpoint.save) were made before the other output paths were checked and before the
    data was read: a refusal left an empty OUT (or OUT/logs) behind. Every output path is now checked
    before the first folder is made, and a refusal once the data is read (a missing file, a token id
    past the vocabulary, found in OUT/data) takes away the folders this run made; an OUT that was
    there stays, without the logs/ and data/ the run made in it."""
    import numpy as np

    from fivefold.cli import main

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    started = []
    monkeypatch.setattr("fivefold.launch.launch", lambda *a, **kw: started.append(a) or 0)
    cfg, blocker, tokens = tmp_path / "c.yaml", tmp_path / "afile", tmp_path / "t.npy"
    cfg.write_text(TINY)
    blocker.write_text("mine")
    np.save(tokens, np.array([1, 2, 300] * 50, dtype=np.int64))
    out = tmp_path / "runs" / "out"
    train = ["train", str(cfg), "--nproc", "1", "--out", str(out)]
    for words, says in (([f"checkpoint.save={blocker}"], f"checkpoint.save (--save) {blocker}: a file is there"),
                        ([f"checkpoint.save={tmp_path / 'ck'}", f"checkpoint.save_hf={blocker}"],
                         f"checkpoint.save_hf (--save-hf) {blocker}: a file is there"),
                        ([f"data.path={tmp_path / 'nope.txt'}", f"checkpoint.save={tmp_path / 'ck'}"],
                         "nope.txt': no such file or folder"),
                        ([f"data.path={tokens}"], "holds token id 300 >= model.vocab_size=256")):
        assert main([*train, *words]) == 2
        assert says in capsys.readouterr().err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "c.yaml", "t.npy"], words
    out.mkdir(parents=True)
    assert main([*train, f"data.path={tokens}"]) == 2
    assert not list(out.iterdir()) and not started


def test_profile_ranks_outside_the_world_are_refused(tmp_path):
    """--profile-ranks 7 on a 2-rank run profiled nothing and said nothing: refused with the range."""
    _refused(_train(tmp_path, TINY, "logging.profile=true", "logging.profile_ranks=[0,7]", nproc=2),
             "logging.profile_ranks (--profile-ranks) [0, 7]: rank(s) 7 not in this 2-rank run; give ranks 0 to 1")


def test_world_size_is_the_number_of_ranks_as_validate_takes_it(tmp_path):
    """`train --world-size N` (validate's flag) starts N ranks, as --nproc N: the layout is checked against it."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(TINY + "parallel: {tensor_model_parallel_size: 2}\n")
    r = subprocess.run([sys.executable, "-m", "fivefold", "train", str(cfg), "--out", str(tmp_path / "out"),
                        "--world-size", "3"], cwd=REPO, capture_output=True, text=True, timeout=120)
    _refused(r, "TP*PP*CP = 2*1*1 = 2 must divide the world size 3")
