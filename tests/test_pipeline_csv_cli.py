"""A hand-written CSV schedule loads, lowers, verifies, simulates and renders; CSV round trip; the CLI."""
from pathlib import Path

import pytest

from fivefold.cli import main
from fivefold.errors import UserError
from fivefold.pipeline.csvio import dumps, load_csv, loads
from fivefold.pipeline.schedules import build_schedule
from fivefold.pipeline.lowering import lower
from fivefold.pipeline.render import draw_png, text_timeline
from fivefold.pipeline.simulate import Costs, simulate
from fivefold.pipeline.verify import verify

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hand_schedule.csv"


def test_hand_written_csv(tmp_path):
    """With F=B=W=1, by hand: rank 1 runs F0 1..2, B0 2..3, F1 3..4, B1 4..5, W0 5..6, F2 6..7, B2
    7..8, W1 8..9, F3 9..10, B3 10..11, W2, W3 -> 13; rank 0 ends with B3 11..12, W3 12..13.
    Makespan 13, busy 12 on each rank: idle 1 each."""
    s = verify(lower(load_csv(EXAMPLE)))
    assert s.placement == (0, 1) and s.num_microbatches == 4
    res = simulate(s, Costs.uniform(2, 1, 1, 1))
    assert res.makespan == 13 and res.idle == [1, 1]
    assert "[F0]" in text_timeline(s, res).splitlines()[0]
    draw_png(s, res, tmp_path / "hand.png")
    assert (tmp_path / "hand.png").read_bytes()[:4] == b"\x89PNG"


def test_csv_round_trip():
    s = build_schedule("dualpipev", 3, 7)
    back = loads(dumps(s), name=s.name)
    assert back == s


def test_csv_errors_name_the_cell():
    with pytest.raises(UserError, match=r"row 1 \(rank 1\): 'Fx' is not an action"):
        loads("0F0,0BW0\nFx\n")
    with pytest.raises(UserError, match="stage 0 is computed on rank 0 and on rank 1"):
        loads("0F0,0BW0\n0F1,0BW1\n")


def test_a_csv_that_is_not_text_is_refused_with_a_message(tmp_path):
    (tmp_path / "s.csv").write_bytes(b"\xff\xfe0F0\n")  # was a UnicodeDecodeError traceback
    with pytest.raises(UserError, match="byte 0xff at offset 0 is not UTF-8"):
        load_csv(tmp_path / "s.csv")


def test_cli_prints_and_draws(tmp_path, capsys):
    png, csv = tmp_path / "s.png", tmp_path / "s.csv"
    assert main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b",
                 "--png", str(png), "--csv", str(csv)]) == 0
    out = capsys.readouterr().out
    assert "rank 0: stages [0], bubble 27.3%" in out  # (p-1)/(m+p-1) = 3/11
    assert "peak in flight 4 stage-microbatches" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["schedule", "--load-csv", str(csv)]) == 0
    assert "bubble 27.3%" in capsys.readouterr().out


def test_cli_refuses_with_the_rule(capsys):
    assert main(["schedule", "--schedule", "interleaved", "--pp", "4", "--vpp", "2",
                 "--microbatches", "6"]) == 2
    assert "multiple of pipeline_model_parallel_size=4" in capsys.readouterr().err
    assert main(["schedule", "--load-csv", str(EXAMPLE), "--costs", "1,1"]) == 2
    capsys.readouterr()
    # a loaded schedule's rows set its ranks and microbatches: generator flags beside it were ignored
    assert main(["schedule", "--load-csv", str(EXAMPLE), "--pp", "8", "--microbatches", "16"]) == 2
    assert "--pp, --microbatches: what a generated schedule is built from, but --load-csv" in capsys.readouterr().err
    assert main(["schedule", "--fb-cost", "2"]) == 2  # 1F1B has no F&B action to cost (it was ignored)
    assert "--fb-cost 2.0: the cost of an overlapped F&B action, and this schedule has none" in capsys.readouterr().err
    assert main(["schedule", "--schedule", "dualpipev", "--fb-cost", "2"]) == 0
    assert main(["schedule", "--group", "4"]) == 2  # 1F1B has no microbatch groups (it was ignored)
    assert "--group 4: groups microbatches per virtual stage, which only --schedule interleaved has" \
        in capsys.readouterr().err


def test_cli_refuses_a_schedule_too_large_to_draw_and_runs_deep_ones(capsys):
    """PP 100000 ran for minutes (no message); now refused at once with the limit. A deep pipeline
    within it runs: the in-order run wakes a rank when its message is sent (a sweep over every rank
    per step of a backward wave was quadratic in PP: 55 s at PP 4000, 2 s at PP 1000)."""
    assert main(["schedule", "--pp", "100000", "--microbatches", "8"]) == 2
    assert "800,000 stage-microbatches: the command simulates and draws at most 262,144" in capsys.readouterr().err
    assert main(["schedule", "--pp", "1000", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert "rank 999: stages [999], bubble 99.6% (idle 2997)" in out  # (p-1)/(m+p-1) = 999/1003


def test_cli_output_files(tmp_path, capsys):
    """`schedule --png / --csv` and `plan --plot` (fivefold.cli._outputs): a picture named for another
    format is refused before any work, a missing folder is made, a path that cannot be written is one
    line (exit 2), never a traceback."""
    png = tmp_path / "new" / "deeper" / "s.png"
    assert main(["schedule", "--pp", "2", "--microbatches", "4", "--png", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the folder should be
    assert main(["schedule", "--pp", "2", "--microbatches", "4", "--csv", str(blocker / "s.csv")]) == 2
    assert f"--csv {blocker / 's.csv'}: cannot write it" in capsys.readouterr().err
    for argv in (["schedule", "--png", str(tmp_path / "s.txt")],
                 ["plan", "--model", "llama3-8b", "--gpus", "8", "--plot", str(tmp_path / "m.jpg")]):
        with pytest.raises(SystemExit) as e:  # argparse: exit 2 with the usage
            main(argv)
        assert e.value.code == 2 and "name the picture FILE.png (or .pdf, .svg)" in capsys.readouterr().err
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--top", "2", "--plot", str(blocker / "m.png")]) == 2
    assert f"--plot {blocker / 'm.png'}: cannot write it" in capsys.readouterr().err


def test_cli_csv_replaces_only_a_schedule_it_wrote(tmp_path, capsys):
    """`schedule --csv FILE` names the file to write: a config or a hand-written schedule there (a user
    who meant --load-csv) is refused before any work and left as it was (it used to be overwritten
    with the generated schedule); a schedule CSV the command wrote before is replaced, as a rerun."""
    config, hand = tmp_path / "demo.yaml", tmp_path / "hand.csv"
    config.write_text("model:\n  num_layers: 2\n")
    hand.write_text(EXAMPLE.read_text())
    for path in (config, hand, tmp_path):
        before = path.read_text() if path.is_file() else None
        assert main(["schedule", "--pp", "2", "--microbatches", "4", "--csv", str(path)]) == 2
        assert f"--csv {path}: a" in capsys.readouterr().err
        assert (path.read_text() if path.is_file() else None) == before
    written = tmp_path / "s.csv"
    assert main(["schedule", "--pp", "2", "--microbatches", "4", "--csv", str(written)]) == 0
    assert main(["schedule", "--pp", "3", "--microbatches", "4", "--csv", str(written)]) == 0
    assert len(load_csv(written).ranks) == 3


def test_cli_output_folders(tmp_path, capsys):
    """A command's output folder (`train --out`, `rl --out`, `plot --out`, export's OUT_DIR) is made
    before any work or rank starts; where it cannot be (a file in the way), one line and exit 2."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n')
    examples = Path(__file__).resolve().parents[1] / "examples"
    for argv, says in ((["train", str(examples / "demo.yaml"), "--out", str(blocker / "run")], f"--out {blocker / 'run'}"),
                       (["rl", str(examples / "grpo.yaml"), "--out", str(blocker)], f"--out {blocker}: a file is there"),
                       (["plot", str(tmp_path), "--out", str(blocker / "p")], f"--out {blocker / 'p'}"),
                       (["export", str(tmp_path), str(blocker / "hf")], f"OUT_DIR's folder {blocker}: a file is there")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and says in err, err
