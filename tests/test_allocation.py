"""AReaL allocation modes and `models:` lists: components, exact global ranks, coordinates per component."""
import pytest

from fivefold.config.allocation import models_allocation, parse_allocation
from fivefold.config.schema import Config
from fivefold.config.load import load_config
from fivefold.config.validate import validate
from fivefold.errors import UserError


def test_legacy_form_seed_003():
    a = parse_allocation("sglang.d2t2p1+d1t4p1")
    gen, train = a.components
    assert a.world_size == 8
    assert (gen.name, gen.role, gen.ranks) == ("sglang", "inference", (0, 1, 2, 3))
    assert (gen.layout.tp, gen.layout.dp) == (2, 2)
    assert (train.role, train.ranks, train.layout.tp, train.layout.dp) == ("training", (4, 5, 6, 7), 4, 1)
    assert train.coords(6)["tp"] == 2 and gen.coords(6) is None


def test_colon_form_disjoint_gpus():
    a = parse_allocation("sglang:d4t2+megatron:d2p2t4")
    gen, train = a.components
    assert gen.ranks == tuple(range(8)) and train.ranks == tuple(range(8, 24))
    assert (train.layout.tp, train.layout.pp, train.layout.dp) == (4, 2, 2)
    assert train.coords(8 + 4) == {"tp": 0, "cp": 0, "dp": 1, "pp": 0}


def test_colocated_components_share_gpus_and_differ_in_coordinates():
    a = parse_allocation("sglang:d4t2|megatron:d2p2t2")
    assert a.world_size == 8
    (_, gen), (_, train) = a.by_rank(5)
    assert gen == {"tp": 1, "cp": 0, "dp": 2, "pp": 0}
    assert train == {"tp": 1, "cp": 0, "dp": 0, "pp": 1}


def test_moe_attn_ffn_split_derives_expert_dp_and_etp_is_1():
    a = parse_allocation("megatron:(attn:d1p2t4|ffn:d1p2e4)")
    lay = a.components[0].layout
    assert (lay.tp, lay.pp, lay.dp, lay.ep, lay.etp, lay.edp) == (4, 2, 1, 4, 1, 1)
    lay = parse_allocation("megatron:(attn:d4p2t2|ffn:p2e4)").components[0].layout
    assert (lay.ep, lay.etp, lay.edp) == (4, 1, 2)


@pytest.mark.parametrize("mode, message", [
    ("megatron:(attn:d1p2t4|ffn:d1p1e4)", "same PP"),
    ("megatron:(attn:d1p2t4|ffn:d2p2e4)", "derived expert DP 1"),
    ("megatron:(attn:d1p2t2|ffn:p2e4)", "must divide attn t*c*d = 2"),
    ("sglang:d4t2|megatron:d2t2", "equal sizes"),
    ("sglang:d2p2+megatron:d2", "d, t and c sizes only"),
    ("foo:d2", "unknown backend 'foo'"),
    ("megatron:d2x4", "not a list of sizes"),
    ("megatron:d2d4", "gives a size twice"),
    ("megatron:d2e4", "must divide t*c*d = 2"),
])
def test_refusals(mode, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("*", r"\*")):
        parse_allocation(mode)


def test_allocation_sets_the_training_config_with_etp_1():
    loaded = load_config(None, ["allocation_mode=sglang:d2t2+megatron:d1t2e2", "num_experts=4"])
    assert loaded.dialect == "areal"
    p = loaded.config.parallel
    assert (p.tensor_model_parallel_size, p.expert_model_parallel_size, p.expert_tensor_parallel_size) == (2, 2, 1)
    validate(loaded.config, loaded.dialect)
    with pytest.raises(UserError, match="uses 6 GPUs; the cluster has 8"):
        load_config(None, ["allocation_mode=sglang:d2t2+megatron:d1t2e2"], world_size=8)


def test_models_list_actor_critic_reference():
    loaded = load_config("examples/multi_model.yaml")
    actor, critic, ref = loaded.allocation.components
    assert (actor.ranks, critic.ranks, ref.ranks) == ((0, 1), (2, 3), (0, 1, 2, 3))
    for c in (actor, critic, ref):
        validate(c.config, loaded.dialect)
    # One GPU, different coordinates per model (seed 003): GPU 3 is TP rank 0 of the critic, 1 of the reference.
    assert dict(loaded.allocation.by_rank(3)) == {"critic": {"tp": 0, "cp": 0, "dp": 0, "pp": 1},
                                                  "reference": {"tp": 1, "cp": 0, "dp": 0, "pp": 1}}
    assert ref.config.parallel.tensor_model_parallel_size == 2 and ref.config.cluster.world_size == 4


def test_models_list_refuses_gpus_beyond_the_world(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("cluster: {world_size: 2}\nmodels:\n  - {name: a, gpus: 0-3}\n")
    with pytest.raises(UserError, match="beyond the world of 2 GPUs"):
        load_config(str(p))


@pytest.mark.parametrize("name, role", [(n, "forward-only") for n in ("reference", "ref", "Ref_Model", "reward-model",
                                                                       "RM", "ref0")]
                         + [(n, "training") for n in ("actor", "critic", "refiner", "warm", "policy")])
def test_models_role_defaults_from_the_name(name, role):
    """A `models:` entry without `role:` is forward-only when a word of its name (split at anything but
    letters, case-insensitive) is ref, reference, reward or rm; trained otherwise."""
    assert models_allocation(Config(), [{"name": name, "gpus": "0-1"}], None).components[0].role == role


def test_models_role_given_and_refused():
    """`role: train | forward` overrides the name (a critic initialised from a reward model, a frozen
    policy); any other value is refused naming the choices."""
    alloc = models_allocation(Config(), [{"name": "reward", "gpus": "0-1", "role": "train"},
                                         {"name": "judge", "gpus": "2-3", "role": "forward"}], None)
    assert [c.role for c in alloc.components] == ["training", "forward-only"]
    assert alloc.training().name == "reward"
    with pytest.raises(UserError, match=r"models\[0\] \(ref\): role 'frozen' is not one of train, forward"):
        models_allocation(Config(), [{"name": "ref", "gpus": "0-1", "role": "frozen"}], None)
    with pytest.raises(UserError, match=r"role \['forward'\] is not one of"):
        models_allocation(Config(), [{"name": "ref", "gpus": "0-1", "role": ["forward"]}], None)
