"""The tolerance helper (tests/_tol.py) and its report (scripts/tolerances.py): what passes, what
fails, what is recorded."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from _tol import LOG_VAR, close, within

inf, nan = float("inf"), float("nan")


@pytest.fixture(autouse=True)
def _no_log(monkeypatch):
    """These calls test the helper: they stay out of a measurement's log (scripts/tolerances.py)."""
    monkeypatch.delenv(LOG_VAR, raising=False)


@pytest.mark.parametrize("got,want,rtol,atol", [
    ([1.0 + 1e-7], [1.0], 1e-6, 0.0),  # inside rtol
    ([1e-7], [0.0], 0.0, 1e-6),  # inside atol
    ({"a": 2.0}, {"a": 2.0}, 0.0, 0.0),  # dicts key by key; equal passes a zero bound
    ([nan, inf], [nan, inf], 0.0, 0.0),  # NaN in both and equal infinities count as equal
    (torch.ones(3, dtype=torch.float32), torch.ones(3, dtype=torch.float64), 0.0, 0.0),
])
def test_close_passes(got, want, rtol, atol):
    close(got, want, rtol=rtol, atol=atol, site="t")


@pytest.mark.parametrize("got,want,rtol,atol,message", [
    ([1.0 + 1e-5], [1.0], 1e-6, 0.0, "exceeds"),
    ([1e-3], [0.0], 1e-6, 0.0, "exceeds"),  # any difference from 0 needs an atol
    ([nan], [1.0], 1.0, 1.0, "exceeds"),  # NaN never passes against a number, however loose
    ([inf], [-inf], 1.0, 1.0, "exceeds"),
    ([1.0, 2.0], [1.0], 1.0, 1.0, "shape"),
    ({"a": 1.0}, {"b": 1.0}, 1.0, 1.0, "keys"),
])
def test_close_fails(got, want, rtol, atol, message):
    with pytest.raises(AssertionError, match=message):
        close(got, want, rtol=rtol, atol=atol, site="t")


def test_every_call_is_recorded_and_reported(tmp_path, monkeypatch, capsys):
    log = tmp_path / "native.jsonl"
    monkeypatch.setenv(LOG_VAR, str(log))
    close([1.0, 2.0 + 2e-7], [1.0, 2.0], rtol=1e-6, site="s.loss", case="a")
    within(3e-6, 1e-5, site="s.norm")
    with pytest.raises(AssertionError):
        within(2e-5, 1e-5, site="s.norm")  # recorded before it fails
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["site"] for r in rows] == ["s.loss", "s.norm", "s.norm"]
    assert rows[0]["max_abs"] == pytest.approx(2e-7, rel=1e-3) and rows[0]["used"] == pytest.approx(0.1, rel=1e-3)
    assert rows[0]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    spec = importlib.util.spec_from_file_location("tolerances", Path(__file__).parent.parent / "scripts" / "tolerances.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["report", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "s.loss" in out and "0.1" in out and "s.norm" in out and "<= 1.0e-05" in out
    assert script.nice_up(1.3e-6) == pytest.approx(2e-6) and script.nice_up(1e-5) == pytest.approx(1e-5)
    assert script._rescaled(0.98, (1e-5, 1e-6, None), (1e-4, 1e-5, None)) == pytest.approx(0.098)
    assert script._rescaled(0.5, (1e-5, 1e-6, None), (1e-4, 1e-6, None)) is None  # not a scaling: measure again
