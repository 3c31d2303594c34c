"""layers_per_stage: Megatron's even and uneven pipeline splits."""
import pytest

from fivefold.config.split import layers_per_stage


@pytest.mark.parametrize("args, expected", [
    ((8, 4), [2, 2, 2, 2]),
    ((8, 2, 2), [2, 2, 2, 2]),                                  # chunk c of rank r at index c*pp + r
    ((126, 8, None, 15, 15), [15] + [16] * 6 + [15]),           # Llama-3 405B on PP8
    ((61, 16, None, 3, 2), [3] + [4] * 14 + [2]),               # DeepSeek-V3 on PP16
    ((10, 4, None, 1), [1, 3, 3, 3]),                           # first only
    ((12, 2, 2, 4, 8), [2, 4, 2, 4]),                           # uneven with interleaving
    ((6, 4, None, None, None, True, True), [1, 2, 2, 1]),       # (6 + 2) / 4, minus embedding/loss
    ((7, 4, None, None, None, True), [1, 2, 2, 2]),
    ((14, 2, 2, None, None, True, True), [3, 4, 4, 3]),
])
def test_splits(args, expected):
    out = layers_per_stage(*args)
    assert out == expected and sum(out) == args[0]


@pytest.mark.parametrize("args, message", [
    ((6, 4), "6 layers do not split evenly into pp*vpp=4*1=4"),
    ((8, 4, None, 3, 2), "3 layers remain for the 2 middle stage(s)"),
    ((8, 1, None, 2), "need pipeline_model_parallel_size > 1"),
    ((8, 2, 2, 3, 5), "pipeline rank 0 holds 3 layers, not divisible by vpp=2"),
    ((8, 2, None, 1, None, True), "cannot be combined"),
    ((8, 2, None, 4, 3), "1 layers remain for the 0 middle stage(s)"),
])
def test_refusals(args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        layers_per_stage(*args)
