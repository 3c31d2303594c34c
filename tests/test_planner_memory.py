"""The memory model against closed forms: Korthikanti et al. (2022) for activations, Megatron's
bytes per parameter for model state, and seed 002's example in its own accounting."""
import pytest

from _tol import close
from fivefold.config.schema import ModelConfig, TrainingConfig
from fivefold.planner.memory.traits import GPT3_TRAITS
from fivefold.planner.memory.activations import Sharding, layer_activation_bytes
from fivefold.planner.layout import Plan
from fivefold.planner.memory.peak import memory_per_rank
from fivefold.planner.memory.states import rank_params, state_bytes_per_param
from fivefold.planner.memory.params import count_params
from fivefold.planner.presets import model_preset
from fivefold.planner.search.configs import make_config
from fivefold.planner.report.seeds import seed_memory_accounting

# GPT-3 175B shape (Korthikanti et al., Table 3): h=12288, a=96, s=2048, 4h GeLU MLP, LayerNorm.
GPT3 = ModelConfig(num_layers=96, hidden_size=12288, num_attention_heads=96, ffn_hidden_size=4 * 12288,
                   vocab_size=51200, normalization="LayerNorm")
S, B, H, A = 2048, 1, 12288, 96


def per_layer(tp=1, sp=False, recompute=None):
    return sum(layer_activation_bytes(GPT3, 0, B, S, Sharding(tp=tp, sp=sp, recompute=recompute), GPT3_TRAITS).values())


@pytest.mark.parametrize("t", [1, 2, 8])
def test_korthikanti_activation_formulas(t):
    sbh, score = S * B * H, 5 * A * S / H
    # Exact equalities (integer byte counts in float64, far below 2**53): equations (1)-(5) of the paper.
    assert per_layer(t) == sbh * (10 + 24 / t + score / t)                   # TP, no SP
    assert per_layer(t, sp=True) == sbh * (34 / t + score / t)                # TP + SP
    assert per_layer(t, sp=True, recompute="selective") == sbh * 34 / t      # + selective recompute
    assert per_layer(t, sp=True, recompute="full") == 2 * sbh / t            # full recompute: layer input
    if t == 1:
        assert per_layer() == sbh * (34 + score)                             # sbh(34 + 5as/h)


def test_state_bytes_per_param():
    assert sum(state_bytes_per_param(TrainingConfig(), "bf16", 8)) == 18
    assert sum(state_bytes_per_param(TrainingConfig(use_distributed_optimizer=True), "bf16", 8)) == 6 + 12 / 8
    assert sum(state_bytes_per_param(TrainingConfig(), "fp32", 8)) == 16
    assert sum(state_bytes_per_param(TrainingConfig(grad_reduce_in_bf16=True), "bf16", 8)) == 16  # bf16 gradients
    assert sum(state_bytes_per_param(TrainingConfig(), "fp16", 8)) == 16  # fp16 gradients (Megatron's default)


def test_model_state_per_rank_sums_to_model():
    # Dense and expert parameters held over all (TP, PP, ETP x EP) shards add up to the padded model.
    m = model_preset("mixtral-8x7b").model
    cfg = make_config(m, 64, 8, 4096, 64, "bf16", dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                                       pipeline_model_parallel_size=4, expert_model_parallel_size=4,
                                                       expert_tensor_parallel_size=1))
    plan = Plan(cfg)
    dense = sum(rank_params(plan, r)[0] for r in range(plan.pp))
    expert = sum(rank_params(plan, r)[1] for r in range(plan.pp))
    c = count_params(m)
    pad = (m.padded_vocab_size(2) - m.vocab_size) * m.hidden_size * 2
    norms = m.num_layers * (2 * m.hidden_size + m.hidden_size * m.num_experts)  # replicated over TP
    close(expert * plan.ep * plan.etp, c.experts, rtol=1e-12, site="planner.expert_params")
    close(dense * plan.tp - norms * (plan.tp - 1) - m.hidden_size * (plan.tp - 1), c.total - c.experts + pad, rtol=1e-12,
          site="planner.dense_params")


def test_seed_002_example_side_by_side():
    seed = seed_memory_accounting(70e9, 4, 4)
    assert (seed.weights, seed.grads, seed.optimizer) == (8.75e9, 8.75e9, 17.5e9)  # the seed's own numbers
    m = model_preset("llama3-70b").model
    cfg = make_config(m, 64, 8, 4096, 64, "bf16", dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=4,
                                                       sequence_parallel=True), distributed_optimizer=False)
    ranks = memory_per_rank(Plan(cfg))
    mid = ranks[1]  # a middle stage: no embedding, no output layer
    per_rank = mid.params
    assert mid.grads == 4 * per_rank and mid.optimizer == 12 * per_rank and mid.weights == 2 * per_rank
    assert [r.inflight for r in ranks] == [4, 3, 2, 1]  # 1F1B: rank r holds PP - r microbatches
    close(ranks[0].activations, 4 * ranks[3].activations, rtol=1e-12, site="planner.activations_1f1b")


@pytest.mark.parametrize("pp,tied", [(1, False), (2, False), (2, True)])
def test_mtp_parameters_per_rank_equal_the_built_stages(pp, tied):
    """With multi-token prediction (2 depths, MoE like the last layer) every pipeline rank's planned
    parameters equal the parameters of the stage fivefold builds for it, exactly: the MTP layers, eh_proj
    and norms on the last rank, and its copy of the embedding under PP when the head is not tied."""
    from fivefold.model.decoder import Decoder

    m = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=300, num_experts=4,
                    moe_router_topk=2, moe_ffn_hidden_size=32, moe_first_k_dense_layers=1, mtp_num_layers=2,
                    tie_word_embeddings=tied)
    plan = Plan(make_config(m, pp, 8, 64, 8, "fp32", dict(pipeline_model_parallel_size=pp)))
    for r in range(pp):
        layers = [i for chunk in plan.rank_chunks[r] for i in chunk]
        stage = Decoder(m, layers=layers, embedding=r == 0, head=r == pp - 1)
        built = sum(p.numel() for p in stage.parameters())  # a tied head is the embedding: counted once
        assert sum(rank_params(plan, r)) == built, (r, layers)
        assert (stage.mtp is not None) == (r == pp - 1)


def test_recompute_modules_drop_exactly_their_tensors():
    """Megatron's --recompute-modules, per layer: each module removes the saved tensors it recomputes
    and nothing else (bytes in float64, exact): core_attn the kernel's saved tensors (the default selective),
    mla_up_proj MLA's q/k/v, layernorm the norms' outputs (the next linears' inputs), mlp a dense MLP's
    intermediates, moe_act the experts' activation output, shared_experts theirs, moe the whole MoE MLP."""
    from fivefold.planner.memory.traits import EAGER_TRAITS

    m = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, ffn_hidden_size=96,
                    multi_latent_attention=True, qk_layernorm=True, q_lora_rank=48, kv_lora_rank=32, qk_head_dim=16,
                    qk_pos_emb_head_dim=8, v_head_dim=16, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                    moe_shared_expert_intermediate_size=32, moe_first_k_dense_layers=1)
    t, b, s = EAGER_TRAITS, 2, 64

    def saved(layer, recompute, *modules):
        sh = Sharding(recompute=recompute, **({"modules": frozenset(modules)} if modules else {}))
        return layer_activation_bytes(m, layer, b, s, sh, t)

    none = {i: saved(i, None) for i in (0, 1)}
    # the kernel's own saved tensors: eager, dn + dr != dv, so v and the output zero-padded for flash
    kernel = {"padded v, padded kernel output", "softmax log-sum-exp (fp32)"}
    assert kernel <= set(none[1]) and "attention scores" not in none[1]
    assert saved(1, "selective") == saved(1, "selective", "core_attn") == \
        {k: v for k, v in none[1].items() if k not in kernel}
    assert "q, k, v" not in saved(1, "selective", "mla_up_proj") and kernel <= set(saved(1, "selective", "mla_up_proj"))
    norms = saved(1, "selective", "layernorm")
    for key in ("qkv input", "mlp input"):
        assert none[1][key] - norms[key] == t.linear_bytes() * b * s * m.hidden_size
    assert "mlp intermediates" not in saved(0, "selective", "mlp")
    assert saved(1, "selective", "mlp") == none[1]  # a MoE layer's MLP is "moe"; core_attn not listed: scores kept
    act = saved(1, "selective", "moe_act")
    copies = m.moe_router_topk * b * s
    assert none[1]["expert activation outputs"] == copies * t.linear_bytes() * 32
    assert "expert activation outputs" not in act and act["expert fc1 outputs"] == none[1]["expert fc1 outputs"]
    assert "shared-expert intermediates" not in saved(1, "selective", "shared_experts")
    moe = saved(1, "selective", "moe")
    assert not any(k.startswith(("router", "expert", "shared")) for k in moe) and moe["q, k, v"] == none[1]["q, k, v"]


def test_offload_and_memory_options_leave_the_device():
    """--offload-modules: each module's input leaves the device for every microbatch in flight but the
    one being computed (bytes exact); --optimizer-cpu-offload removes its share of the optimizer state;
    torchtitan's op-level SAC keeps the layer input, the attention output and the larger half of the
    matmul outputs; Megatron's memory-efficient permutation drops the experts' outputs."""
    from dataclasses import replace
    from fivefold.config.validate import validate
    from fivefold.errors import UserError
    from fivefold.planner.memory.traits import ArchTraits
    from fivefold.planner.memory.kinds import MemoryAssumptions
    from fivefold.planner.memory.peak import peak_memory

    m = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=300, num_experts=4,
                    moe_router_topk=2, moe_ffn_hidden_size=32)
    cfg = make_config(m, 4, 1, 64, 16, "bf16", dict(pipeline_model_parallel_size=4))
    base = Plan(cfg).config
    before = peak_memory(Plan(base), MemoryAssumptions())
    t = base.training
    t.use_distributed_optimizer, t.use_precision_aware_optimizer, t.optimizer_cpu_offload = True, True, True
    t.optimizer_offload_fraction = 0.25
    t.fine_grained_activation_offloading, t.offload_modules = True, ["expert_fc1", "attn_norm"]
    after = peak_memory(Plan(base), MemoryAssumptions())
    assert after.rank == before.rank == 0 and after.inflight == before.inflight == 4
    sh = Sharding()
    per_layer = [layer_activation_bytes(m, i, 1, 64, sh, ArchTraits().for_precision("bf16")) for i in range(1)]
    off = sum(d["expert inputs"] + d["attn norm input"] for d in per_layer)  # rank 0 holds layer 0
    assert before.activations - after.activations == off * (before.inflight - 1)
    t.offload_modules = ["expert_fc2"]
    with pytest.raises(UserError, match="unknown expert_fc2"):
        validate(base)
    t.offload_modules, t.fine_grained_activation_offloading = ["moe_act"], False
    with pytest.raises(UserError, match="fine-grained-activation-offloading"):
        validate(base)
    sac = layer_activation_bytes(m, 0, 1, 64, Sharding(recompute="selective"), ArchTraits(op_level_sac=True))
    # q 64, k 64, v 64, o 64, router 4 -> kept: q + v + router (132) vs k + o (128)
    assert sac["every other matmul output"] == 64 * 132 * 2  # tokens x elements x bf16
    lean = layer_activation_bytes(m, 0, 1, 64, sh, ArchTraits(expert_outputs_saved=False))
    full = layer_activation_bytes(m, 0, 1, 64, sh, ArchTraits())
    assert full.keys() - lean.keys() == {"expert outputs"}
