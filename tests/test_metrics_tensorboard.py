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
