"""`fivefold validate` and `fivefold layout` as a user runs them."""
import subprocess
import sys

import pytest

from fivefold.cli import main

EXAMPLES = [
    (["examples/fivefold.yaml"], "TP=2 CP=2 PP=2 DP=1"),
    (["examples/rlinf.yaml"], "TP=2 CP=2 PP=2 DP=16"),
    (["examples/skyrl_overrides.txt"], "SkyRL turns sequence parallelism on"),
    (["examples/bridge_overrides.txt", "--world-size", "64"], "TP=4 CP=1 PP=4 DP=4"),
    (["examples/megatron_flags.txt"], "experts: ETP=2 EP=4 EDP=1"),
    (["examples/areal_allocation.txt"], "== train (training) on GPUs 4-7"),
    (["examples/multi_model.yaml"], "== reference (forward-only) on GPUs 0-3"),
    (["tp=2", "pp=2", "--nodes", "2", "--gpus-per-node", "4"], "TP=2 CP=1 PP=2 DP=2"),
    (["--tensor-model-parallel-size", "2", "--world-size", "4"], "dialect: megatron"),
]


@pytest.mark.parametrize("argv, expected", EXAMPLES, ids=[a[0] for a, _ in EXAMPLES])
def test_examples_validate(argv, expected, capsys):
    assert main(["validate", *argv]) == 0
    assert expected in capsys.readouterr().out


def test_invalid_config_lists_every_problem_exit_2_no_traceback():
    r = subprocess.run([sys.executable, "-m", "fivefold", "validate", "tp=3", "sp=true", "cp=2",
                        "seq_length=66", "--world-size", "12"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "seq_length=66 is not" in r.stderr


def test_unknown_key_exit_2_with_suggestion(capsys):
    assert main(["validate", "parallel.tensor_model_paralel_size=2"]) == 2
    assert "did you mean parallel.tensor_model_parallel_size" in capsys.readouterr().err


def test_invalid_table_through_the_cli(capsys):
    from tests.test_config_invalid import CASES
    for words, world, message in CASES:
        assert main(["validate", *words.split(), "--world-size", str(world)]) == 2
        assert message in capsys.readouterr().err


def test_layout_grid_and_allocation(capsys):
    assert main(["layout", "--tp", "2", "--pp", "2", "--cp", "2", "--world-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "TP=2 CP=2 PP=2 DP=2" in out and "tp-cp-dp" in out
    assert main(["layout", "sglang.d2t2p1+d1t4p1", "--rank", "5"]) == 0
    out = capsys.readouterr().out
    assert "GPU 5: train: tp=1 cp=0 dp=0 pp=0" in out
    assert main(["layout", "examples/multi_model.yaml", "--rank", "3"]) == 0
    assert "GPU 3: critic: tp=0 cp=0 dp=0 pp=1 | reference: tp=1 cp=0 dp=0 pp=1" in capsys.readouterr().out
    assert main(["layout", "--tp", "2", "--ep", "4", "--etp", "3", "--world-size", "8"]) == 2
    # Megatron-LM's names for the sizes, as validate takes them (were "unrecognized arguments")
    assert main(["layout", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                 "--context-parallel-size", "2", "--world-size", "16"]) == 0
    assert "TP=2 CP=2 PP=2 DP=2" in capsys.readouterr().out
    assert main(["layout", "--tp", "2", "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1",
                 "--world-size", "8"]) == 0
    assert "ETP=1 EP=4" in capsys.readouterr().out
    # an allocation carries its sizes: grid flags beside it were ignored silently
    assert main(["layout", "sglang.d2t2p1+d1t4p1", "--tp", "4", "--order", "tp-dp-cp-ep-pp"]) == 2
    assert "--tp, --order: sizes of a grid, but sglang.d2t2p1+d1t4p1 carries its own" in capsys.readouterr().err


def test_a_folder_for_a_config_and_two_models_of_one_name_are_named(capsys, tmp_path):
    assert main(["validate", "examples"]) == 2
    assert "config file examples is a folder: give a file in it" in capsys.readouterr().err  # was "not found"
    twins = tmp_path / "twins.yaml"
    twins.write_text("cluster: {world_size: 4}\nmodels:\n  - {name: a, gpus: 0-1}\n  - {name: a, gpus: 2-3}\n")
    assert main(["validate", str(twins)]) == 2  # each model's report was headed "== a" twice
    assert "models[1]: a second model named 'a': give each model its own name" in capsys.readouterr().err


def test_layout_refuses_an_expert_tp_it_would_not_print(capsys):
    """The report draws the expert grid under EP > 1 only: `--etp 2` at EP=1 was dropped without a word."""
    assert main(["layout", "--etp", "2", "--world-size", "8"]) == 2
    assert "--etp 2 with EP=1: the expert grid (ETP x EP x EDP) is printed for EP > 1" in capsys.readouterr().err
    assert main(["layout", "--tp", "2", "--etp", "2", "--world-size", "8"]) == 0  # ETP = TP: nothing dropped


def test_layout_grid_rank_shows_its_coordinates_and_groups(capsys):
    """`layout --tp ... --rank R` without an allocation: R's coordinates and the group of each kind
    holding it, each the one of the layout's own groups (`Layout.named_groups`) that holds R (the flag
    was ignored there: the whole grid printed, and a rank outside the world passed)."""
    from fivefold.topology import Layout
    lay = Layout(tp=2, cp=2, pp=2, dp=2, ep=2, etp=2)
    named = lay.named_groups()
    for rank in (0, 5, 15):
        assert main(["layout", "--tp", "2", "--pp", "2", "--cp", "2", "--ep", "2", "--world-size", "16",
                     "--rank", str(rank)]) == 0
        out = capsys.readouterr().out
        coords = " ".join(f"{d}={v}" for d, v in (lay.dense.coords(rank) | lay.expert.coords(rank)).items())
        assert f"rank {rank}: {coords}" in out
        shown = dict(line.split() for line in out.split("its groups:\n")[1].splitlines())
        for name, groups in named.items():
            holding = [g for g in groups if rank in g]
            assert shown.get(name) == (f"[{','.join(map(str, holding[0]))}]" if holding else None), name
    assert main(["layout", "--tp", "2", "--world-size", "8", "--rank", "8"]) == 2
    assert "--rank 8 is outside the 8 ranks" in capsys.readouterr().err
    assert main(["layout", "--tp", "2", "--world-size", str(10**10), "--rank", "99999"]) == 0  # never builds a group
    assert "  tp-cp-dp        [0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,...10000000000 ranks]" in capsys.readouterr().out


def test_every_unknown_megatron_flag_is_named_at_once():
    """A pasted Megatron script with several flags we do not know: one message names them all, each
    with its closest known flag, instead of one per attempt."""
    from fivefold.config.megatron import parse_flags
    from fivefold.errors import UserError

    with pytest.raises(UserError) as e:
        parse_flags(["--num-layers", "2", "--tensor-model-paralel-size", "2", "--frobnicate", "a", "b",
                     "--seq-lenght", "64", "--hidden-size", "64"])
    msg = str(e.value)
    assert msg.startswith("unknown flags ")
    for name, hint in (("--tensor-model-paralel-size", "--tensor-model-parallel-size"), ("--frobnicate", None),
                       ("--seq-lenght", "--seq-length")):
        assert name in msg and (hint is None or hint in msg), msg


@pytest.mark.parametrize("config", ["examples/multi_model.yaml", "examples/areal_allocation.txt"])
def test_train_refuses_several_models_before_any_rank_starts(config, capsys, tmp_path):
    """`train` runs one model; a config naming several is refused (exit 2), never trained in part."""
    assert main(["train", config, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "several models" in err and "not implemented yet" in err
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_commands_that_do_not_train_start_without_torch():
    """`fivefold` builds every command's parser at start; importing torch there cost ~2 s (of a
    0.5 s `validate` or `plan --help`) before any command ran. Only the commands that touch tensors
    (train, convert, plot, export, rl) load it, when they run."""
    script = ("import sys\nfrom fivefold.cli import main\n"
              "assert main(['validate', 'examples/fivefold.yaml']) == 0\n"
              "assert main(['plan', '--model', 'llama3-8b', '--gpus', '8', '--top', '1']) == 0\n"
              "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout[-500:]


@pytest.mark.parametrize("argv, fix", [
    (["train", "examples/demo.yaml", "--nproc", "3"], "(fix: --nproc 4)"),
    (["validate", "examples/demo.yaml", "--world-size", "3"], "(fix: --world-size 4)"),
    (["estimate", "examples/demo.yaml", "--gpus", "3"], "(fix: --gpus 4)"),
    (["train", "examples/demo.yaml", "world_size=3"], "(fix: world_size=4)"),
])
def test_a_world_size_fix_names_the_flag_that_set_the_world(argv, fix, capsys, tmp_path):
    """Where a flag gave the world size, the fix names that flag: a world_size=N word would not override it."""
    out = ["--out", str(tmp_path / "out")] if argv[0] == "train" else []
    assert main(argv + out) == 2
    said = capsys.readouterr()
    assert "must divide the world size 3 " + fix in said.out + said.err
    assert not (tmp_path / "out").exists()


def test_a_world_size_fix_under_torchrun_names_its_world(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.delenv("FIVEFOLD_LAUNCHED", raising=False)
    assert main(["train", "examples/demo.yaml", "--out", str(tmp_path / "out")]) == 2
    assert "(fix: torchrun's --nnodes x --nproc-per-node = 4)" in capsys.readouterr().err


def test_validate_sizes_the_vocabulary_by_the_tokenizer_as_megatron_and_train_do(tmp_path, capsys):
    """The vocabulary printed is the run's: Megatron sizes the model by its tokenizer (NullTokenizer: --vocab-size
    ids + the end of document; a GPT-2 BPE vocab.json: its entries) and pads it to a multiple of
    --make-vocab-size-divisible-by x TP (128257 -> 129024 at TP8, as Megatron's _vocab_size_with_padding)."""
    import json

    from fivefold.cli import main

    shape = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "64",
             "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "1", "--world-size", "8"]
    assert main(["validate", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256",
                 "--tensor-model-parallel-size", "8", *shape]) == 0
    out = capsys.readouterr().out
    assert "vocab 128257 padded to 129024 (multiple of 128 x TP" in out
    assert "model.vocab_size=128256: model.vocab_size set to 128257 from NullTokenizer" in out
    vocab = {f"t{i}": i for i in range(300)}
    (tmp_path / "vocab.json").write_text(json.dumps({**vocab, "<|endoftext|>": 300}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    assert main(["validate", "--vocab-file", str(tmp_path / "vocab.json"), "--merge-file", str(tmp_path / "merges.txt"),
                 "--tensor-model-parallel-size", "2", *shape]) == 0
    assert "vocab 301 padded to 512 (multiple of 128 x TP" in capsys.readouterr().out
    assert main(["validate", "--vocab-file", str(tmp_path / "missing.json"), *shape]) == 0  # not here: the layout still
    assert "not read here" in capsys.readouterr().out
