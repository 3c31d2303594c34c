"""Activation memory: which tensors each decoder layer saves for its backward, in bytes.

Counted per microbatch of b sequences of s tokens, per rank, following Korthikanti et al. (2022),
"Reducing Activation Recomputation in Large Transformer Models", Sec. 4. A tensor saved for the
backward is one of three kinds:
  - in the sequence-parallel region (norm inputs, the inputs of the first linear of each block,
    dropout masks): split by TP only with SP, else replicated in the TP group;
  - inside attention / MLP (Q, K, V, the attention output, MLP intermediates): split by TP;
  - the attention scores (softmax output, dropout mask, dropout output), a*s*s per sequence, only
    when attention is not a fused (flash) kernel: split by TP.
Every per-token term is divided by CP (each CP rank holds s/cp tokens; Ulysses all-to-all CP trades
heads for tokens, same count). With the GPT-3 architecture (LayerNorm, GeLU 4h MLP, dropout, 16-bit,
stored scores) the sum is sbh(34 + 5as/h) per layer; with TP t: sbh(10 + 24/t + 5as/(ht)); with
TP + SP: sbh(34/t + 5as/(ht)); selective recompute (of the attention core) drops the score term;
full recompute keeps only each layer's input, 2sbh (2sbh/t with SP).

Implementation traits (`traits.py`) say how many tensors the code that runs keeps where
Megatron's fused kernels keep fewer.

Routed experts (dropless, balanced routing, Megatron's all-to-all dispatcher): a rank of an
expert-TP group of size etp processes N_e = k*b*s*etp/(tp*cp) token copies; it saves their inputs
(N_e*h), the gate/up outputs and the down-projection input (N_e*3*f_e/etp) and the expert outputs
for the probability-weighted combine (k*b*s*h/(tp*cp): its own assignments, after the expert-TP
reduce-scatter; dropped or padding rows are not among them), plus the router's fp32 scores (E per
token).

A forward-only model (an RL reference, planner/search/forward.py) saves nothing: `forward_layer_bytes` is
what one layer's no-grad forward holds at its peak, `logprob_bytes_per_logit` what its log-prob
computation holds per logit.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from fivefold.capacity import padded_size
from fivefold.config.schema import ModelConfig
from fivefold.frozen import hashed_once
from fivefold.planner.memory.params import is_moe_layer, kv_tp_split
from fivefold.planner.memory.traits import ArchTraits


@hashed_once
@dataclass(frozen=True)
class Sharding:
    tp: int = 1
    sp: bool = False
    cp: int = 1
    etp: int = 1
    recompute: str | None = None
    """None, 'selective' (the `modules`) or 'full'."""
    modules: frozenset[str] = frozenset({"core_attn"})
    """With selective recompute: Megatron's recompute modules (fivefold.config.modules)."""

    def recomputes(self, module: str) -> bool:
        return self.recompute == "selective" and module in self.modules

    @classmethod
    def of(cls, tp: int = 1, sp: bool = False, cp: int = 1, etp: int = 1, recompute: str | None = None,
           modules: frozenset[str] = frozenset({"core_attn"})) -> "Sharding":
        """One object per distinct sharding (`_interned`): the planner's caches key on it, and equal
        keys then compare by identity, not field by field."""
        return _interned(cls, tp, sp, cp, etp, recompute, modules)


@lru_cache(maxsize=4096)
def _interned(cls, tp, sp, cp, etp, recompute, modules) -> Sharding:
    return cls(tp, sp, cp, etp, recompute, modules)


def routed_share(m: ModelConfig, tokens: float) -> float:
    """Expert rows computed (and dispatched) per routed assignment of a router call over `tokens`
    tokens (b s / (tp cp): a rank's tokens of one micro-batch): 1 dropless, routing balanced as
    everywhere here; with a capacity factor c, min(1, c) (balanced routing fills every expert to
    n k / E, so only c < 1 drops); padded to capacity, every expert computes exactly
    padded_size(n, k, E, c) rows (fivefold.capacity): E x that / (n k)."""
    c = m.moe_expert_capacity_factor
    if c is None:
        return 1.0
    k, E = m.moe_router_topk, m.num_experts
    if m.moe_pad_expert_input_to_capacity:
        n = max(1, round(tokens))
        return E * padded_size(n, k, E, c) / (n * k)
    return min(1.0, c)


def routed_copies(m: ModelConfig, b: int, s: int, sh: Sharding) -> float:
    """Token copies one rank's experts compute per microbatch: the k b s / (tp cp) assignments of its
    router call, gathered over expert TP, at `routed_share` rows each."""
    n = b * s / (sh.tp * sh.cp)
    return m.moe_router_topk * n * sh.etp * routed_share(m, n)


def kv_heads_and_dims(m: ModelConfig, tp: int) -> tuple[int, int, int]:
    """(K / V heads of one TP rank, key dim, value dim): what context parallelism exchanges per token
    (MLA's keys carry the shared rope part; replicated KV heads count once)."""
    if m.multi_latent_attention:
        return max(1, m.kv_heads // tp), m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim
    return max(1, m.kv_heads // tp), m.head_dim, m.head_dim


def gathered_kv_bytes(m: ModelConfig, b: int, s: int, sh: Sharding, traits: ArchTraits) -> float:
    """All-gather CP's backward temporaries in one attention layer: the K and V gathered from the group
    again and their gradients at full length (TransformerEngine's AttnFuncWithCPAndKVAllGather, and
    ours: fivefold/parallel/context/allgather_attention.py, whose gradients are fp32 under bf16), b s tokens of
    the TP rank's K / V heads, twice."""
    g, d, dv = kv_heads_and_dims(m, sh.tp)
    return 2 * b * s * g * (d + dv) * traits.value_bytes()


def _attention_elements(m: ModelConfig) -> tuple[int, int]:
    """(Q+K+V elements, attention-output elements) per token over all heads."""
    a = m.num_attention_heads
    if m.multi_latent_attention:
        dqk = m.qk_head_dim + m.qk_pos_emb_head_dim
        return a * dqk * 2 + a * m.v_head_dim, a * m.v_head_dim
    d = m.head_dim
    return a * d + 2 * m.kv_heads * d, a * d


def _norm_saved(traits: ArchTraits, B: float) -> float:
    """Bytes a norm keeps per value of its input beside its output: fused, the input; unfused (eager),
    x in fp32 (the input itself in fp32, a copy under 16-bit) and x / rms(x) in the run's dtype."""
    return 4 + B if traits.norm_tensors == 3 else (traits.norm_tensors - 1) * B


def _qkv_per_rank(m: ModelConfig, tp: int) -> float:
    """Q + K + V elements per token on one TP rank: q by TP, k and v by TP or, when TP exceeds the KV
    heads, one whole KV head each (`params.kv_tp_split`)."""
    qkv, _ = _attention_elements(m)
    if m.multi_latent_attention:
        return qkv / tp
    kv = 2 * m.kv_heads * m.head_dim
    return (qkv - kv) / tp + kv / kv_tp_split(m, tp)


def layer_activation_bytes(m: ModelConfig, index: int, b: int, s: int, sh: Sharding,
                           traits: ArchTraits = ArchTraits()) -> dict[str, float]:
    """Bytes saved for backward by decoder layer `index` for one microbatch on one rank, by tensor."""
    B = traits.value_bytes()
    h, a = m.hidden_size, m.num_attention_heads
    tokens = b * s / sh.cp  # tokens of this microbatch on this rank before any TP split
    sp_div = sh.tp if sh.sp else 1
    if sh.recompute == "full":
        return {"layer input (full recompute)": tokens * h * B / sp_div}
    if sh.recompute == "selective" and traits.op_level_sac:
        return op_sac_saved(m, index, tokens, sh, B)
    out: dict[str, float] = {}
    mask = 1.0 if traits.dropout else 0.0
    # Attention block: norm input, QKV-linear input, (dropout mask) in the SP region.
    LB = traits.linear_bytes()  # a linear layer's saved input (fp8 under TE's fp8 recipes)
    norm_out = 0 if sh.recomputes("layernorm") else LB  # the norm's output is the next linear's input
    norm_input = _norm_saved(traits, B) * tokens * h / sp_div
    out["attn norm input"] = norm_input
    out["qkv input"] = norm_out * tokens * h / sp_div
    qkv, attn_out = _attention_elements(m)
    if m.multi_latent_attention:
        # the down-projections' outputs (the up-projections' inputs); with --qk-layernorm each latent
        # norm keeps its input (+ x/rms(x) unfused) besides its output (the query latent's output and
        # the KV latent c, a view of the [c, k_pe] output, whose storage it keeps)
        normed = traits.norm_tensors - 1 if m.qk_layernorm else 0
        r_q, r_kv = m.q_lora_rank or 0, m.kv_lora_rank
        latents = r_q * (1 + normed) + (r_kv + m.qk_pos_emb_head_dim) + r_kv * normed
        out["MLA latents"] = tokens * latents * B / sp_div
    if not (m.multi_latent_attention and sh.recomputes("mla_up_proj")):
        out["q, k, v"] = tokens * _qkv_per_rank(m, sh.tp) * B
    if m.qk_layernorm and not m.multi_latent_attention:  # the q / k norms keep their inputs, as a pre-norm
        q_and_k = _qkv_per_rank(m, sh.tp) - m.kv_heads * m.head_dim / kv_tp_split(m, sh.tp)  # less v
        out["q, k norm inputs"] = _norm_saved(traits, B) * tokens * q_and_k
    out["attention output (proj input)"] = tokens * attn_out * LB / sh.tp
    padded = traits.flash_needs_equal_head_dims and m.multi_latent_attention and \
        m.qk_head_dim + m.qk_pos_emb_head_dim != m.v_head_dim
    if not sh.recomputes("core_attn"):
        if padded:  # the kernel keeps v zero-padded to the q/k width and its padded output (whose dv slice
            dqk = m.qk_head_dim + m.qk_pos_emb_head_dim  # is copied for the projection, counted above)
            out["padded v, padded kernel output"] = tokens * a * (2 * dqk - m.v_head_dim) * B / sh.tp
        if traits.flash_attention:
            out["softmax log-sum-exp (fp32)"] = tokens * a * 4 / sh.tp
        else:  # softmax output (B), dropout mask (1 byte), dropout output (B): per head, s keys per query
            out["attention scores"] = tokens * a * s * (B + mask * (1 + B)) / sh.tp
    out["dropout masks"] = 2 * tokens * h * mask / sp_div
    # MLP block: norm input and first-linear input in the SP region.
    out["mlp norm input"] = norm_input
    out["mlp input"] = norm_out * tokens * h / sp_div
    inner = traits.mlp_inner_tensors or (3 if traits.gated_mlp else 2)  # SwiGLU: gate, up, gate*up ; GeLU: pre, post
    inner_bytes = (inner - 1) * B + LB  # the last is the down-projection's input
    if is_moe_layer(m, index):
        if sh.recomputes("moe"):  # the whole MoE MLP reruns from its input (kept above)
            return out
        f_e = m.moe_ffn_hidden_size or m.ffn_size
        copies = routed_copies(m, b, s, sh)  # rows on this rank's experts
        out["router scores (fp32)"] = tokens * m.num_experts * 4 / sp_div
        out["expert inputs"] = copies * h * LB
        if traits.expert_outputs_saved:  # the combine's: k per token of this rank's (dropped ones zero)
            out["expert outputs"] = m.moe_router_topk * tokens / sh.tp * h * B
        out["expert fc1 outputs"] = copies * (inner - 1) * B * f_e / sh.etp
        if not sh.recomputes("moe_act"):  # the activation's output: the down-projection's input
            out["expert activation outputs"] = copies * LB * f_e / sh.etp
        if m.moe_shared_expert_intermediate_size and not sh.recomputes("shared_experts"):
            out["shared-expert intermediates"] = tokens * inner_bytes * m.moe_shared_expert_intermediate_size / sh.tp
    elif not sh.recomputes("mlp"):
        out["mlp intermediates"] = tokens * inner_bytes * m.ffn_size / sh.tp
    return out


def matmul_outputs(m: ModelConfig, index: int, sh: Sharding) -> list[float]:
    """Elements per token of the outputs of decoder layer `index`'s matmuls, in forward order (on
    one rank): q, k, v (MLA: the query and KV up-projections), o; the dense MLP's gate, up and down,
    or a MoE layer's router and shared experts (routed experts run grouped GEMMs, not matmuls).
    Column-parallel outputs split by TP, row-parallel ones (h) by TP with SP."""
    h, a = m.hidden_size, m.num_attention_heads
    sp_div = sh.tp if sh.sp else 1
    if m.multi_latent_attention:
        attn = [a * (m.qk_head_dim + m.qk_pos_emb_head_dim) / sh.tp, a * (m.qk_head_dim + m.v_head_dim) / sh.tp]
    else:
        attn = [a * m.head_dim / sh.tp, m.kv_heads * m.head_dim / sh.tp, m.kv_heads * m.head_dim / sh.tp]
    if not is_moe_layer(m, index):
        return attn + [h / sp_div, m.ffn_size / sh.tp, m.ffn_size / sh.tp, h / sp_div]
    f_s = m.moe_shared_expert_intermediate_size or 0
    return attn + [h / sp_div, m.num_experts] + ([f_s / sh.tp, f_s / sh.tp, h / sp_div] if f_s else [])


def op_sac_saved(m: ModelConfig, index: int, tokens: float, sh: Sharding, B: int) -> dict[str, float]:
    """torchtitan's op-level SAC (`ArchTraits.op_level_sac`): a block keeps its input, the flash
    kernel's output and log-sum-exp, and the outputs of every other matmul: the policy counts matmuls
    over the block's forwards, so which half is kept alternates between steps; the larger half counts."""
    mm = matmul_outputs(m, index, sh)
    _, attn_out = _attention_elements(m)
    return {"layer input (op-level SAC)": tokens * m.hidden_size * B / (sh.tp if sh.sp else 1),
            "attention output + log-sum-exp": tokens * (attn_out * B + m.num_attention_heads * 4) / sh.tp,
            "every other matmul output": tokens * max(sum(mm[0::2]), sum(mm[1::2])) * B}


def full_recompute_transient(m: ModelConfig, index: int, b: int, s: int, sh: Sharding,
                             traits: ArchTraits = ArchTraits()) -> float:
    """With full recompute, the one layer being recomputed holds its whole activations in backward."""
    inner = Sharding.of(tp=sh.tp, sp=sh.sp, cp=sh.cp, etp=sh.etp, recompute=None)
    return sum(layer_activation_bytes(m, index, b, s, inner, traits).values())


def _mlp_width(m: ModelConfig, index: int, b: int, s: int, sh: Sharding) -> float:
    """f-wide elements per microbatch on this rank: dense f/tp per token, or the routed copies'
    f_e/etp (+ shared experts' f_s/tp)."""
    tokens = b * s / sh.cp
    if not is_moe_layer(m, index):
        return tokens * m.ffn_size / sh.tp
    copies = routed_copies(m, b, s, sh)
    f_s = m.moe_shared_expert_intermediate_size or 0
    return copies * (m.moe_ffn_hidden_size or m.ffn_size) / sh.etp + tokens * f_s / sh.tp


def backward_transient(m: ModelConfig, index: int, b: int, s: int, sh: Sharding, traits: ArchTraits) -> float:
    """Bytes of the temporaries at the peak of one layer's backward (`ArchTraits.backward_inner_tensors`)."""
    return traits.backward_inner_tensors * _mlp_width(m, index, b, s, sh) * traits.value_bytes()


def weight_grad_join_bytes(m: ModelConfig, index: int, b: int, s: int, sh: Sharding, traits: ArchTraits) -> float:
    """Zero-bubble schedules: bytes a layer keeps per microbatch between its input-gradient (B) and
    weight-gradient (W) halves, beyond its saved activations: the gradient recorded at each linear's
    output (pipeline/backward.py's joins): q, k, v and gate/up outputs (split by TP), the o and down
    outputs (h each, whole: a row-parallel output before its reduction; a MoE layer's down outputs
    per routed row, and its shared experts' per token), the two norms' gain products (h each, split
    by TP only with SP), per-head q / k norms' (q and k, split by TP). Measured, ZB-H1 x TP2 MoE
    with shared experts and q / k norms: 0.933 of the last stage without the last two."""
    qkv, _ = _attention_elements(m)
    tokens = b * s / sh.cp
    down = tokens * m.hidden_size
    if is_moe_layer(m, index):
        down = routed_copies(m, b, s, sh) * m.hidden_size + (down if m.moe_shared_expert_intermediate_size else 0.0)
    per_token = qkv / sh.tp + m.hidden_size + 2 * m.hidden_size / (sh.tp if sh.sp else 1)
    if m.qk_layernorm and not m.multi_latent_attention:
        per_token += (m.num_attention_heads + m.kv_heads) * m.head_dim / sh.tp
    gate_up = 2 * _mlp_width(m, index, b, s, sh)
    return (tokens * per_token + down + gate_up) * traits.value_bytes()


def forward_layer_bytes(m: ModelConfig, index: int, b: int, s: int, sh: Sharding, traits: ArchTraits,
                        ep: int = 1) -> float:
    """The most decoder layer `index`'s forward holds without autograd (an RL reference's log-probs under
    no_grad: nothing is saved for a backward), bytes on one rank beyond the layer's input: the largest of
    the moments our eager layer (fivefold.model.block) goes through, each with the tensors alive then
    (measured op by op on CPU: benchmarks/planner_vs_measured.py --forward).
    Attention, beside its normed input: under SP the input's all-gather (`_gather_moment`), then the
    gathered input beside q, k, v; RoPE on q (x cos, the rotated half, its product: 3 q beside q, k, v),
    then on k (beside the old and the new q); the kernel's output and fp32 log-sum-exp; o_proj's output
    through its reduction (`_reduce_moment`), q, k, v still referenced. MLP, beside the attention's output,
    the residual sum and the normed input (h each, split by TP only with SP): the gather and the gate / up
    outputs; the inner tensors of `ArchTraits.mlp_inner_tensors` (eager SwiGLU: gate, up, silu(gate),
    their product, 4 f); the down-projection's output through its reduction beside one fewer. A MoE
    layer's MLP instead holds its router's fp32 scores and its routed rows (gathered by expert; under EP
    also received and sent back) beside the experts' outputs and inner tensors (every local expert's at
    once with grouped GEMMs, `moe_grouped_gemm` True or unset as on CUDA; one expert's at a time in the
    loop), then their concatenation and the weighted combine; shared experts as a dense MLP after it."""
    B = traits.value_bytes()
    h, tokens = m.hidden_size, b * s / sh.cp
    sp_div = sh.tp if sh.sp else 1
    hs, whole = tokens * h * B / sp_div, tokens * h * B  # a hidden state as held, and gathered / unreduced
    gather = _gather_moment(hs, whole) if sh.sp else 0.0
    gathered = whole if sh.sp else 0.0
    reduce = _reduce_moment(hs, whole, sh, traits)
    qkv = tokens * _qkv_per_rank(m, sh.tp) * B
    _, attn_out = _attention_elements(m)
    o = tokens * attn_out * B / sh.tp
    lse = tokens * m.num_attention_heads * 4 / sh.tp
    rope = 0.0
    if m.multi_latent_attention:  # the latents beside the projections (RoPE on the narrow rope part only)
        qkv += tokens * ((m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_pos_emb_head_dim) * B / sp_div
    elif m.position_embedding_type == "rope":
        q = tokens * m.num_attention_heads * m.head_dim * B / sh.tp
        k = (qkv - q) / 2
        rope = max(3 * q, q + 3 * k)
    attention = hs + max(gather, gathered + qkv, qkv + rope, qkv + o + lse, qkv + o + reduce)
    inner = traits.mlp_inner_tensors or (3 if traits.gated_mlp else 2)

    def dense(f: float) -> float:  # a dense MLP of f bytes per inner tensor
        return max(gather, gathered + 2 * f, inner * f, (inner - 1) * f + reduce)

    residual = 3 * hs  # the attention's output, x + it, and the MLP's normed input
    if not is_moe_layer(m, index):
        return max(attention, residual + dense(tokens * m.ffn_size / sh.tp * B))
    copies = routed_copies(m, b, s, sh)
    rows = copies * h * B
    f_e = m.moe_ffn_hidden_size or m.ffn_size
    at_once = copies / (m.num_experts / ep) if m.moe_grouped_gemm is False else copies  # the loop: one expert's
    experts = 2 * rows + inner * at_once * f_e / sh.etp * B
    routed = max(experts, 3 * rows + hs) + (2 * rows if ep > 1 else 0.0)
    router = tokens / sp_div * m.num_experts * 4
    shared = m.moe_shared_expert_intermediate_size
    mlp = residual + max(router + routed, hs + dense(tokens * shared / sh.tp * B) if shared else 0.0)
    return max(attention, mlp)


def _gather_moment(hs: float, whole: float) -> float:
    """Bytes our all-gather along the sequence (fivefold.runtime.collectives) holds beside its input at its
    end: the input moved to the front (a contiguous copy), the gathered buffer and its copy moved back."""
    return hs + 2 * whole


def _reduce_moment(hs: float, whole: float, sh: Sharding, traits: ArchTraits) -> float:
    """Bytes a row-parallel output holds through its reduction (fivefold.runtime.comm): the partial sum;
    under TP its clone, all-reduced in place; under SP its copy moved to the front, the output chunk and
    that chunk moved back, and a copy of the input where the backend reduces one (`reduce_scatter_copy`,
    gloo: measured, it outlives the call on one of two ranks)."""
    if sh.tp == 1:
        return whole
    if not sh.sp:
        return 2 * whole
    return 2 * whole + 2 * hs + (whole if traits.reduce_scatter_copy else 0.0)


def logprob_bytes_per_logit(B: int, tp: int, padded: bool) -> float:
    """Bytes per local logit at the peak of Engine.forward's log-prob and entropy of one chunk
    (fivefold.engine.engine `_stats`): the logits themselves (B, the run's dtype) and, on one rank,
    log_softmax in fp32, its exp and their product (the entropy's terms), 12; under TP
    (fivefold.parallel.tensor.cross_entropy, vocab-parallel) z - max and its exp, 8, and the logits in fp32, 4
    more unless they are fp32 already and no padding column is masked."""
    if tp == 1:
        return B + 12.0
    return B + 8.0 + (4.0 if B < 4 or padded else 0.0)
