"""`fivefold train` through the CLI: user mistakes end with a clear message, exit 2, no traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
    """--out holding a run, no --load: the run starts over and replaces metrics.jsonl (silently before),
    keeping the checkpoints; the note names the newest and how to resume. Nothing said for a fresh
    folder or a run that loads."""
    from fivefold.cli.train import _note_an_earlier_run
    from fivefold.config.schema import Config

    monkeypatch.delenv("RANK", raising=False)
    out = tmp_path / "out"
    (out / "checkpoints" / "step_00000004").mkdir(parents=True)
    (out / "checkpoints" / "step_00000004" / "metadata.json").write_text("{}")
    _note_an_earlier_run(Config(), out)
    assert capsys.readouterr().err == ""  # no metrics.jsonl: not a run
    (out / "metrics.jsonl").write_text('{"step": 0, "loss": 5.0}\n')
    _note_an_earlier_run(Config(), out)
    assert ("replaces its metrics.jsonl; its checkpoints (up to step_00000004) stay, give --load "
            f"{out / 'checkpoints'} to resume") in capsys.readouterr().err
    resumed = Config()
    resumed.checkpoint.load = str(out / "checkpoints")
    _note_an_earlier_run(resumed, out)
    assert capsys.readouterr().err == ""
