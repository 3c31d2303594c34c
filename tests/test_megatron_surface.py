"""Megatron-LM's whole argument surface (pinned, generated from its parser) classified: mapped, no
effect here (listed by `validate`), not built (all refused at once), or unknown."""
from __future__ import annotations

import re

import pytest

from fivefold.config.load import load_config
from fivefold.config.megatron import FLAGS, parse_flags
from fivefold.config.megatron_surface import SURFACE, SURFACE_FILE, no_effect
from fivefold.config.validate import validate
from fivefold.errors import NotImplementedYet, UserError

LEGACY = {"--virtual-pipeline-model-parallel-size"}
"""Flags of older Megatron-LM versions kept in the map (the pinned commit names them otherwise)."""


def test_the_surface_is_megatrons_and_every_mapped_flag_is_in_it():
    assert SURFACE_FILE.read_text().startswith("# Megatron-LM argument surface at commit d98e8a64dd")
    assert len(SURFACE) > 800 and SURFACE["--swiglu"] == "switch" and SURFACE["--data-path"] == "list"
    assert {f for f, flag in FLAGS.items() if not flag.ours and f not in SURFACE} == LEGACY


@pytest.mark.parametrize("flag", ["--squared-relu", "--init-method-xavier-uniform",
                                  "--fp4-format", "--heterogeneous-layers-config-path"])
def test_math_changing_flags_are_not_taken_as_no_effect(flag):
    assert flag in SURFACE and flag not in FLAGS and no_effect(flag) is None


def test_llama3_8b_fp8_script_refuses_only_what_is_not_built():
    """Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh, its flags scaled to a tiny model: the
    speed and logging flags are accepted (and listed), every flag not built is named in one message; its
    fp8 flags are read (fp8 for the planner; `train` refuses fp8, tests/test_train_cli.py)."""
    words = ("--use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
             "--group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 64 "
             "--max-position-embeddings 64 --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 "
             "--attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --normalization RMSNorm --init-method-std 0.0134 "
             "--attention-backend fused --apply-layernorm-1p --untie-embeddings-and-output-weights "
             "--disable-bias-linear --micro-batch-size 1 --global-batch-size 8 --train-samples 1953125000 "
             "--lr-decay-samples 1949218748 --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001 "
             "--decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0 "
             "--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 "
             "--cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc --empty-unused-memory-level 1 "
             "--exit-duration-in-mins 235 --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max "
             "--fp8-param-gather --tensor-model-parallel-size 2 --context-parallel-size 1 --sequence-parallel "
             "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --mock-data "
             "--tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path cache --split 99,1,0 "
             "--no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1 --log-interval 1 "
             "--eval-iters 32").split()
    with pytest.raises(NotImplementedYet) as e:
        parse_flags(words)
    named = str(e.value).split("Megatron-LM flags ")[1].split(" (they change")[0].split(", ")
    assert named == ["--decoupled-lr", "--decoupled-min-lr"]
    kept = [w for w in words if w not in set(named)]  # without them (and their values) it is read
    drop_values = {"5.0e-4", "4.5e-5"}
    loaded = load_config(None, [w for w in kept if w not in drop_values])
    notes = " ".join(str(w) for w in loaded.warnings)
    for flag in ("--use-mcore-models", "--overlap-grad-reduce", "--num-workers", "--fp8-amax-history-len"):
        assert flag in notes
    assert "--manual-gc" not in notes and loaded.config.training.manual_gc  # built (fivefold.train.manual_gc)
    m = loaded.config.model  # the model flags are mapped (config.megatron_defaults fills the rest)
    assert (m.activation, m.normalization, m.add_bias_linear, m.position_embedding_type, m.apply_layernorm_1p,
            m.attention_dropout, m.hidden_dropout, m.tie_word_embeddings) == \
        ("swiglu", "RMSNorm", False, "rope", True, 0.0, 0.0, False)
    # --fp8-format makes the run fp8 beside --bf16 (Megatron's delayed scaling); --fp8-param-gather needs it
    t = loaded.config.training
    assert (t.precision, t.fp8_format, t.fp8_recipe, t.fp8_param_gather) == ("fp8", "hybrid", "delayed", True)
    validate(loaded.config)
    without = load_config(None, [w for w in kept if w not in drop_values | {"--fp8-format", "hybrid"}])
    with pytest.raises(UserError, match="fp8 primary weights need fp8 training"):
        validate(without.config)


@pytest.mark.parametrize("flag, hint", [
    ("--tp", "did you mean --tensor-model-parallel-size, or tp=N?"),
    ("--vpp", "did you mean --num-virtual-stages-per-pipeline-rank, or vpp=N?"),
    ("--sp", "did you mean --sequence-parallel, or sp=true?"),
    ("--dp", "data parallelism is what the world size leaves"),
])
def test_short_layout_names_given_as_flags_suggest_megatrons(flag, hint):
    """fivefold's short names (tp=2) given as flags (--tp 2, as `layout` takes them) name Megatron's flag
    and the word (they suggested --sft or --mtp-hsm); --dp, which no Megatron flag sets, says why."""
    with pytest.raises(UserError, match=re.escape(hint)):
        parse_flags([flag, "2"])


def test_unknown_and_unbuilt_flags_are_reported_together():
    with pytest.raises(UserError, match=r"unknown flag --swigluu \(did you mean --swiglu\?\) \| Megatron-LM flag "
                                        r"--squared-relu \(they change what is trained\): not implemented yet"):
        parse_flags(["--swigluu", "--squared-relu"])
    with pytest.raises(NotImplementedYet, match=r"--rotary-percent 0.5 \(accepted: 1, 1.0\)"):
        parse_flags(["--rotary-percent", "0.5"])


def test_flags_megatrons_own_examples_pass_are_taken_as_megatron_takes_them():
    """--recompute-activations is Megatron-LM's alias of --recompute-granularity selective; --tiktoken-pattern
    is read only by its TikTokenizer, so with another tokenizer it changes nothing (its GPT examples pass it)."""
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "256"]
    loaded = load_config(None, base + ["--recompute-activations", "--tiktoken-pattern", "v2"], world_size=8)
    assert loaded.config.training.recompute_granularity == "selective"
    assert no_effect("--tiktoken-pattern") and "TikTokenizer" in no_effect("--tiktoken-pattern")
    listed = [w.rule for w in loaded.warnings if w.field == "megatron flags"]
    assert len(listed) == 1 and "accepted without effect here: --tiktoken-pattern: read only by Megatron's " \
        "TikTokenizer" in listed[0], listed


@pytest.mark.parametrize("split, weights", [("'99,1,0'", [99.0, 1.0, 0.0]), ("969,30,1", [969.0, 30.0, 1.0]),
                                            ("98 2", [98.0, 2.0]), ('"90/10"', [90.0, 10.0])])
def test_split_is_read_as_megatron_reads_it(split, weights):
    """Megatron's example scripts pass --split "'99,1,0'" (quotes inside the value); Megatron reads the numbers
    by the pattern [.0-9]+, so the quotes are no part of them."""
    from fivefold.config.data_split import split_problem, split_weights

    assert split_problem(split) is None and split_weights(split) == weights


def test_moe_layer_freq_is_megatrons_list_expression_and_its_refusal_comes_with_the_others():
    """--moe-layer-freq is a Python expression Megatron evaluates: "([0]+[1]*26)" (a list not repeated) is one
    dense layer first; a pattern not built is named in one message with every other flag not built."""
    from fivefold.config.megatron import first_dense_layers

    assert [first_dense_layers(t) for t in ("([0]+[1]*26)", "([0]*3+[1]*58)", "[0,0,1,1]", "1", "'[1]*4'")] == \
        [1, 3, 2, 0, 0]
    with pytest.raises(NotImplementedYet) as refused:
        parse_flags(["--moe-layer-freq", "([1,0]*4)", "--use-tp-pp-dp-mapping"])
    assert "--moe-layer-freq ([1,0]*4): dense layers after MoE layers" in str(refused.value)
    assert "--use-tp-pp-dp-mapping" in str(refused.value)


def test_a_flag_given_and_set_aside_by_megatrons_rules_is_not_listed_as_not_given():
    """--moe-router-pre-softmax with sigmoid scores (Megatron applies it to softmax only) and --num-query-groups
    without --group-query-attention were given: they are noted as set aside by Megatron's rules, with the
    reason, never among the defaults taken because a flag was not given."""
    words = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
             "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "1", "--num-experts", "4",
             "--moe-router-topk", "2", "--moe-router-pre-softmax", "--moe-router-score-function", "sigmoid",
             "--num-query-groups", "2"]
    loaded = load_config(None, words, world_size=8)
    notes = {w.field: w.rule for w in loaded.warnings}
    assert "moe_router_pre_softmax" not in notes["megatron defaults"]
    assert "num_query_groups" not in notes["megatron defaults"]
    assert "model.num_query_groups=None (--group-query-attention not given" in notes["megatron rules"]
    assert "model.moe_router_pre_softmax=False (Megatron-LM applies" in notes["megatron rules"]
    assert loaded.config.model.num_query_groups is None and not loaded.config.model.moe_router_pre_softmax
