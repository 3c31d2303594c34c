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


def _refused(argv, capsys) -> str:
    """What `fivefold *argv` says on stderr, after checking it ends with exit 2 and no traceback: a
    UserError returns 2, an argparse type error exits 2 with the usage."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, (argv, code, err)
    return err


def test_cli_refuses_costs_that_are_not_finite(capsys):
    """nan/inf costs (and a finite sum past the largest float) reached the text timeline as a NaN
    makespan: `ValueError: cannot convert float NaN to integer`, exit 1. Refused as -1 is."""
    for costs in ("nan,1,1", "1,inf,1", "-1,1,1"):
        assert f"--costs '{costs}': each cost must be a finite number >= 0" in _refused(
            ["schedule", "--pp", "4", "--microbatches", "8", f"--costs={costs}"], capsys)
    assert "argument --fb-cost: inf: must be a finite number >= 0" in _refused(
        ["schedule", "--schedule", "dualpipev", "--pp", "2", "--microbatches", "4", "--fb-cost", "inf"], capsys)
    assert "the makespan overflows a float (inf); give smaller numbers" in _refused(
        ["schedule", "--costs", "1e308,1e308,1e308"], capsys)
    # only the ratios matter: costs far below 1 (where width / makespan overflowed) draw as 1,1,1 does
    assert main(["schedule", "--costs", "1,1,1"]) == 0
    ones = capsys.readouterr().out.splitlines()[:4]
    assert main(["schedule", "--costs", "1e-320,1e-320,1e-320"]) == 0
    assert capsys.readouterr().out.splitlines()[:4] == ones


def test_cli_load_csv_is_held_to_the_generated_limit(tmp_path, capsys):
    """A CSV naming microbatch 1e20 hung (the verifier walked every microbatch up to it); 1e6 took 4 s
    and printed 2,000,003 lines. Now the limit on generated schedules (262,144 stage-microbatches) is
    checked cell by cell while reading, and a list of problems is cut to its first lines and a count."""
    csv = tmp_path / "s.csv"
    for cell, total in (("0F1000000", "1,000,001"), ("0F99999999999999999999", "100,000,000,000,000,000,000")):
        csv.write_text(f"{cell},0BW1\n")
        err = _refused(["schedule", "--load-csv", str(csv)], capsys)
        assert f"row 0 (rank 0): {cell} makes it at least 1 stages x {total} microbatches" in err
        assert "at most 262,144" in err
    csv.write_text("0F1000,0BW1000\n")  # 2,000 missing F/BW, one line each before
    err = _refused(["schedule", "--load-csv", str(csv)], capsys)
    assert "0F0 is missing" in err and "... and 1,980 more (2,000 problems in all)" in err
    assert len(err.splitlines()) < 30
    csv.write_text("99999F0,99999BW0\n")  # within the limit, but 99,999 stages are never computed
    err = _refused(["schedule", "--load-csv", str(csv)], capsys)
    assert "stages [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, ... (99,999 in all)] are never computed" in err
    csv.write_text("0SEND_F0>1\n1RECV_F0<0\n")  # no computation: was `max() arg is an empty sequence`
    assert "schedule CSV computes nothing" in _refused(["schedule", "--load-csv", str(csv)], capsys)


def test_cli_prints_only_the_grid_around_the_first_problem(tmp_path, capsys):
    """The grid printed with a refused CSV grew with it: 10,000 rows printed a 10,000-line grid, a
    long row a line as long. Now it is cut to GRID_RANKS x GRID_STEPS around the first problem (the
    offending cell still marked), with a line saying which ranks / steps are shown and how many not."""
    from fivefold.pipeline.verify import GRID_RANKS, GRID_STEPS

    csv = tmp_path / "s.csv"
    rows = [f"{r}F0,{r}BW0" for r in range(300)]
    rows[150] = "150BW0"  # its forward missing
    csv.write_text("\n".join(rows) + "\n")
    err = _refused(["schedule", "--load-csv", str(csv)], capsys)
    assert "rank 150 step 1: 150BW0 runs before 150F0" in err and ">>150BW0<<" in err
    assert "grid cut around rank 150 step 3: showing ranks 134-165 of 300 (268 left out)" in err
    assert len(err.splitlines()) < GRID_RANKS + 10 and "rank 133 " not in err and "rank 166 " not in err
    m = 200
    csv.write_text(",".join([f"0F{i}" for i in range(m)] + [f"0BW{i}" for i in range(m - 1)]) + "\n")
    err = _refused(["schedule", "--load-csv", str(csv)], capsys)
    assert "0BW199 (or 0B199 + 0W199) is missing" in err
    assert f"showing steps {2 * m - 1 - GRID_STEPS}-{2 * m - 2} of {2 * m - 1} " in err
    assert max(len(line) for line in err.splitlines()) < 20 * GRID_STEPS
    csv.write_text(EXAMPLE.read_text().replace("\n1F0,", "\n"))  # a small grid: whole, as before
    err = _refused(["schedule", "--load-csv", str(csv)], capsys)
    assert ">>1B0<<" in err and "grid cut" not in err and err.splitlines()[-1].startswith("rank 1  >>1B0<<")


def test_cli_refuses_nonsense_numbers(capsys):
    """Each was accepted with exit 0: --p2p -1 shrank the makespan below the no-latency one, nan gave a
    0% bubble, --width 0 an empty timeline, --costs 0,0,0 makespan 0. Each number flag has its range."""
    for argv, says in (
            (["--p2p", "-1"], "argument --p2p: -1: must be a finite number >= 0"),
            (["--p2p", "nan"], "argument --p2p: nan: must be a finite number >= 0"),
            (["--schedule", "dualpipev", "--fb-cost", "-1"], "argument --fb-cost: -1: must be a finite number >= 0"),
            (["--width", "0"], "argument --width: 0: must be a whole number of characters from 1 to 10,000"),
            (["--width", "-5"], "argument --width: -5: must be a whole number of characters from 1 to 10,000"),
            (["--width", "100000"], "argument --width: 100000: must be a whole number of characters from 1 to 10,000"),
            (["--costs", "0,0,0"], "--costs '0,0,0': all three 0 leaves nothing to time"),
            (["--pp", "0"], "argument --pp: 0: must be a whole number >= 1"),
            (["--pp", "-1000", "--microbatches", "-1000"], "argument --pp: -1000: must be a whole number >= 1"),
            (["--microbatches", "0"], "argument --microbatches: 0: must be a whole number >= 1"),
            (["--schedule", "interleaved", "--vpp", "0"], "argument --vpp: 0: must be a whole number >= 1"),
            (["--schedule", "interleaved", "--vpp", "2", "--group", "-4"],
             "argument --group: -4: must be a whole number >= 1")):
        assert says in _refused(["schedule", *argv], capsys)
    assert main(["schedule", "--costs", "0,0,1", "--p2p", "0.5", "--width", "1"]) == 0  # the edges of each range
