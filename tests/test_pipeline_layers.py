"""Layers per stage for every placement: even, uneven (first/last, account-for), explicit, DualPipeV's V."""
import re

import pytest

from fivefold.config.schema import ParallelConfig
from fivefold.errors import UserError
from fivefold.pipeline.schedules import build_schedule
from fivefold.pipeline.layers import stage_layer_counts, stage_layers


def test_even_split_contiguous_in_stage_order():
    s = build_schedule("interleaved", 2, 4, 2)
    assert stage_layers(8, s, ParallelConfig()) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert s.stages_of(0) == [0, 2]  # rank 0 builds layers 0-1 and 4-5


def test_megatron_first_last_on_ranks():
    s = build_schedule("1f1b", 4, 4)
    p = ParallelConfig(decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=3)
    assert stage_layer_counts(8, s, p) == [1, 2, 2, 3]


def test_dualpipev_first_rank_holds_both_ends():
    s = build_schedule("dualpipev", 2, 4)  # stages 0,3 on rank 0; 1,2 on rank 1
    p = ParallelConfig(decoder_first_pipeline_num_layers=2, decoder_last_pipeline_num_layers=6)
    # rank 0 has 2 layers over its 2 chunks (1 each), rank 1 has 6 (3 each)
    assert stage_layer_counts(8, s, p) == [1, 3, 3, 1]
    acc = ParallelConfig(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    assert stage_layer_counts(6, s, acc) == [1, 2, 2, 1]  # (6 + 2) / 4 = 2, minus one at each end


def test_explicit_list_and_refusals():
    s = build_schedule("gpipe", 2, 2)
    assert stage_layers(5, s, ParallelConfig(pipeline_layers_per_stage=[3, 2])) == [[0, 1, 2], [3, 4]]
    with pytest.raises(UserError, match="2 stages"):
        stage_layer_counts(5, s, ParallelConfig(pipeline_layers_per_stage=[1, 1, 3]))
    with pytest.raises(UserError, match="do not split evenly"):
        stage_layer_counts(5, s, ParallelConfig())


def test_megatron_layout_string_places_the_stages():
    """--pipeline-model-parallel-layout: validate turns the string into decoder layers per virtual stage
    and VPP = stages / PP (interleaved), as Megatron-LM derives them, an empty stage included; a string
    that does not fit the sizes, or puts an MTP layer (m) away from the loss (our runtime runs MTP beside
    the loss), is refused naming why (the latter by `train` alone: Megatron runs it, so the planner takes it).
    Training with it is the run with the same explicit pipeline_layers_per_stage (the runtime reads only
    the resolved list)."""
    from fivefold.errors import NotImplementedYet
    from fivefold.config.supported import check_supported
    from fivefold.config.load import load_config
    from fivefold.config.schema import to_dict
    from fivefold.config.validate import ConfigError, validate
    base = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--pipeline-model-parallel-size", "2"]

    def validated(words):
        config = load_config(None, base + words, world_size=2).config
        validate(config, "megatron")
        return config

    def resolved(layout, *extra):
        config = validated(list(extra) + ["--pipeline-model-parallel-layout", layout])
        p = config.parallel
        explicit = validated(list(extra) + ["--pipeline-layers-per-stage", *map(str, p.pipeline_layers_per_stage),
                                            "--virtual-pipeline-model-parallel-size",
                                            str(p.virtual_pipeline_model_parallel_size or 1)])
        p.pipeline_model_parallel_layout = None  # the one field the runtime does not read
        assert to_dict(config) == to_dict(explicit), layout  # what trains is the explicit split's run
        return p.pipeline_layers_per_stage, p.virtual_pipeline_model_parallel_size, p.pipeline_schedule

    assert resolved("Et*3|t*5L") == ([3, 5], None, "1f1b")
    assert resolved("Et*2|(tt|)*2t*2L") == ([2, 2, 2, 2], 2, "interleaved")
    assert resolved("Et*8|L") == ([8, 0], None, "1f1b")
    assert resolved("Et*2|t*2|t*2|t*2mL", "--mtp-num-layers", "1") == ([2, 2, 2, 2], 2, "interleaved")
    away = load_config(None, base + ["--mtp-num-layers", "1", "--pipeline-model-parallel-layout", "Et*3m|t*5L"],
                       world_size=2).config
    validate(away, "megatron")
    assert away.parallel.pipeline_layers_per_stage == [3, 5]
    with pytest.raises(NotImplementedYet, match=re.escape("an MTP layer (m) in another pipeline stage than the loss")):
        check_supported(away)
    for layout, extra, says in (("Et|(tt|)*3tL", [], "has 5 stages, not a multiple of pipeline_model_parallel_size=2"),
                                ("Et*3|t*4L", [], "places 7 decoder layers (t); num_layers=8"),
                                ("Et*3|t*5L", ["--mtp-num-layers", "1"], "places 0 MTP layers (m); mtp_num_layers=1"),
                                ("Et*3|t*5L", ["--virtual-pipeline-model-parallel-size", "2"], "VPP=1; virtual_pipeline"),
                                ("Et*3|t*5L", ["--decoder-first-pipeline-num-layers", "3"], "places the layers itself"),
                                ("Et*3(|t*5L", [], "'(' without ')'"),
                                ("t*3|Et*5L", [], "E (the embedding) must be in the first stage only")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            resolved(layout, *extra)
