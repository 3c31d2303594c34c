"""Every option of torchrun (torch/distributed/run.py's parser) is taken, accepted with a note, or
refused as unknown; none is skipped silently."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

from fivefold.config.load import load_config
from fivefold.config.torchrun import BY_NAME, SINCE, SWITCH, VALUE
from fivefold.errors import UserError


def torchrun_parser_options() -> dict[str, str]:
    """Option -> switch / value, read from the installed torch's run.py source (no torch import)."""
    run_py = Path(importlib.util.find_spec("torch").submodule_search_locations[0]) / "distributed" / "run.py"
    out = {}
    for node in ast.walk(ast.parse(run_py.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and a.value.startswith("-")]
            action = next((ast.unparse(k.value) for k in node.keywords if k.arg == "action"), "")
            for name in names:
                out[name] = SWITCH if action in ("check_env", "'store_true'") else VALUE
    return out


def test_the_table_is_torchruns_whole_option_list():
    """The table is the installed torch's option list and the options later releases added (`SINCE`:
    on torch 2.11 --shutdown-timeout is not in the parser)."""
    options = torchrun_parser_options()
    assert len(options) > 50 and "--nproc-per-node" in options
    installed = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    assert {name: spec[0] for name, spec in BY_NAME.items() if SINCE.get(name, (0, 0)) <= installed} == options


def test_a_full_torchrun_line_sets_the_cluster_and_lists_the_rest():
    words = ("python -m torch.distributed.run --nnodes=1:4 --nproc_per_node 8 --rdzv-backend c10d "
             "--rdzv-endpoint host:29400 --max-restarts 3 --standalone --tee 3 pretrain_gpt.py "
             "--tensor-model-parallel-size 2 --num-layers 2").split()
    loaded = load_config(None, words)
    c = loaded.config
    assert (c.cluster.num_nodes, c.cluster.gpus_per_node, c.parallel.tensor_model_parallel_size) == (1, 8, 2)
    notes = " ".join(map(str, loaded.warnings))
    for option in ("--rdzv-backend c10d", "--max-restarts 3", "--tee 3"):
        assert option in notes


@pytest.mark.parametrize("line", ["torchrun --no-python mytrainer --num-layers 2",
                                  "torchrun --nproc-per-node=gpu -m fivefold train --num-layers 2"])
def test_switches_take_no_value(line):
    assert load_config(None, line.split()).config.model.num_layers == 2


def test_an_unknown_option_is_refused_with_the_closest():
    with pytest.raises(UserError, match=r"unknown torchrun option --nproc-per-nodes \(did you mean --nproc-per-node"):
        load_config(None, "torchrun --nproc-per-nodes 2 train.py --num-layers 2".split())
