"""What `fivefold plan --emit` prints is a config our own loader reads back to the same layout."""
import pytest

from fivefold.config.load import load_config
from fivefold.config.validate import validate
from fivefold.planner.emit import emit
from fivefold.planner.presets import hardware, model_preset
from fivefold.planner.search import search

SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
         "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel")
SUFFIX = {"fivefold": ".yaml", "rlinf": ".yaml", "megatron": ".txt", "torchrun": ".txt", "skyrl": ".txt"}


@pytest.fixture(scope="module")
def planned():
    """The five best layouts of an MoE model on 64 GPUs (EP, PP, VPP and TP all occur among them)."""
    r = search(model_preset("mixtral-8x7b").model, hardware("h100-sxm"), 64, 8, 4096, 1024)
    return [c.config for c in r.ranked[:5]]


@pytest.mark.parametrize("fmt", sorted(SUFFIX))
def test_emitted_config_reads_back_to_the_same_layout(fmt, planned, tmp_path):
    for i, cfg in enumerate(planned):
        path = tmp_path / f"plan{i}{SUFFIX[fmt]}"
        path.write_text(emit(cfg, fmt))
        loaded = load_config(str(path), world_size=64, gpus_per_node=8)
        validate(loaded.config, loaded.dialect)  # raises on any broken rule
        back = loaded.config
        for name in SIZES:
            assert getattr(back.parallel, name) == getattr(cfg.parallel, name), (fmt, name, path.read_text())
        assert back.training.micro_batch_size == cfg.training.micro_batch_size
        assert back.training.global_batch_size == cfg.training.global_batch_size
