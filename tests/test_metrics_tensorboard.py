"""TensorBoard logging (on by default): written when the package imports, one note when it does not."""
import sys

import pytest

from fivefold.train.metrics import MetricsLog, read_metrics


def test_missing_tensorboard_is_said_once_and_metrics_still_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import raise ImportError
    log = MetricsLog(tmp_path, tensorboard=True)
    log.write({"step": 0, "loss": 1.5})
    log.close()
    err = capsys.readouterr().err
    assert err.count("note: logging.tensorboard is on but the tensorboard package is not importable") == 1
    assert "pip install tensorboard" in err and "logging.tensorboard=false" in err
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 0, "loss": 1.5}]
    assert not (tmp_path / "tensorboard").exists()


def test_tensorboard_off_says_nothing(tmp_path, capsys):
    MetricsLog(tmp_path, tensorboard=False).close()
    assert capsys.readouterr().err == ""


def test_tensorboard_events_written_when_installed(tmp_path, capsys):
    pytest.importorskip("tensorboard", reason="not installed here; `make setup` installs it (pyproject.toml)")
    log = MetricsLog(tmp_path, tensorboard=True)
    log.write({"step": 0, "loss": 1.5, "lr": 1e-3})
    log.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert "note:" not in capsys.readouterr().err


def test_tensorboard_dir_and_megatron_logging_flags(tmp_path):
    pytest.importorskip("tensorboard", reason="not installed here; `make setup` installs it (pyproject.toml)")
    from fivefold.config.load import load_config

    loaded = load_config(None, ["--num-layers", "2", "--tensorboard-dir", str(tmp_path / "tb"),
                                "--wandb-project", "p", "--wandb-exp-name", "e"])
    lg = loaded.config.logging
    assert (lg.tensorboard_dir, lg.wandb_project, lg.wandb_exp_name) == (str(tmp_path / "tb"), "p", "e")
    log = MetricsLog(tmp_path, tensorboard=True, tensorboard_dir=lg.tensorboard_dir)
    log.write({"step": 0, "loss": 1.5})
    log.close()
    assert any((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_wandb_without_the_package_is_refused_with_the_fix(tmp_path, monkeypatch):
    from fivefold.errors import UserError
    from fivefold.train.metrics import check_wandb

    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    check_wandb(None)  # off: nothing to check
    with pytest.raises(UserError, match=r"wandb_project='p'.*pip install wandb"):
        check_wandb("p")


def test_wandb_runs_offline_and_gets_every_scalar(tmp_path, monkeypatch):
    """Our side of W&B's API (init / log / finish), recorded by a stand-in module: offline mode, the
    run's folder under OUT, each numeric metric at its step."""
    import types

    calls = []
    run = types.SimpleNamespace(log=lambda d, step: calls.append(("log", d, step)), finish=lambda: calls.append(("finish",)))
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or run)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = MetricsLog(tmp_path, tensorboard=False, wandb_project="p", wandb_exp_name="e")
    log.write({"step": 3, "loss": 1.5, "note": "x"})
    log.close()
    assert calls == [("init", {"project": "p", "name": "e", "dir": str(tmp_path), "mode": "offline"}),
                     ("log", {"loss": 1.5}, 3), ("finish",)]


def test_moe_per_layer_fields_become_scalars_and_expert_histograms(tmp_path):
    """A {layer: number} field is one TensorBoard scalar per layer; a {layer: [count per expert]} field
    a histogram whose bucket e holds expert e's count."""
    pytest.importorskip("tensorboard", reason="not installed here; `make setup` installs it (pyproject.toml)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(tmp_path, tensorboard=True)
    log.write({"step": 3, "loss": 1.5, "moe_load_imbalance_per_layer": {"1": 1.25, "2": 2.0},
               "moe_tokens_per_expert": {"1": [5, 0, 3, 8], "2": [16, 0, 0, 0]}})
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"histograms": 0}).Reload()
    assert [(e.step, e.value) for e in events.Scalars("moe_load_imbalance_per_layer/layer_2")] == [(3, 2.0)]
    hist = events.Histograms("moe_tokens_per_expert/layer_1")[0]
    assert hist.step == 3 and list(hist.histogram_value.bucket) == [5, 0, 3, 8]
    assert list(hist.histogram_value.bucket_limit) == [0.5, 1.5, 2.5, 3.5] and hist.histogram_value.num == 16
