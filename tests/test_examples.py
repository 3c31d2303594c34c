"""Every training example in examples/ validates and asks only for what the runtime builds
(tests/test_pipeline_train_cli.py and test_train_tp.py run them through the CLI)."""
import pytest

from fivefold.config.load import load_config
from fivefold.config.validate import validate
from fivefold.config.supported import check_supported, unsupported


@pytest.mark.parametrize("name", ["demo.yaml", "tp_sp.yaml", "pp.yaml", "cp.yaml", "bf16_zero2.yaml"])
def test_training_example_validates_and_is_supported(name):
    loaded = load_config(f"examples/{name}")
    validate(loaded.config, loaded.dialect)
    check_supported(loaded.config)


def test_the_main_job_is_multi_dimensional():
    # The README's main job: tensor x data parallel with sequence parallelism.
    p = load_config("examples/demo.yaml").config.parallel
    assert p.tensor_model_parallel_size == 2 and p.sequence_parallel


def test_pp_with_tp_and_cp_runs():
    loaded = load_config("examples/pp.yaml", ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                         world_size=8)
    validate(loaded.config, loaded.dialect)
    check_supported(loaded.config)  # PP x TP x SP runs
    loaded = load_config("examples/pp.yaml", ["--context-parallel-size", "2"], world_size=8)
    assert not unsupported(loaded.config)  # PP x CP runs too (tests/test_cp.py)
