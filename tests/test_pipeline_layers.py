"""Layers per stage for every placement: even, uneven (first/last, account-for), explicit, DualPipeV's V."""
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
