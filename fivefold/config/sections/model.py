"""model: the architecture (sizes, attention, MLP, MoE, MTP, normalisation, positions), a section of
fivefold.config.schema.Config, and the values its choice fields take."""
from __future__ import annotations

from dataclasses import dataclass

DISPATCHERS = ("alltoall", "allgather", "flex")
NORMALIZATIONS = ("RMSNorm", "LayerNorm")
ACTIVATIONS = ("swiglu", "gelu")
POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")
DROP_POLICIES = ("probs", "position")
QK_NORM_SCOPES = ("head", "projection")
ROUTER_SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
ROUTER_DTYPES = (None, "fp32", "fp64")


@dataclass(kw_only=True)
class ModelConfig:
    num_layers: int = 2
    """Decoder layers. Default 2."""
    hidden_size: int = 64
    """Residual stream width h. Default 64."""
    ffn_hidden_size: int | None = None
    """Dense MLP width (SwiGLU inner size). Default None = 4h (rounded as Llama: 8h/3 to 64)."""
    num_attention_heads: int = 4
    """Query heads a. Default 4."""
    num_query_groups: int | None = None
    """KV heads (grouped-query attention). Default None = num_attention_heads (MHA)."""
    kv_channels: int | None = None
    """head_dim, independent of hidden/heads. Default None = hidden_size / num_attention_heads."""
    vocab_size: int = 256
    """Tokenizer vocabulary (before padding). Default 256 (the byte tokenizer)."""
    make_vocab_size_divisible_by: int = 128
    """Padded vocabulary is a multiple of this x TP (Megatron). Default 128."""
    max_position_embeddings: int = 4096
    """Longest sequence RoPE is set up for, in tokens. Default 4096."""
    normalization: str = "RMSNorm"
    """RMSNorm or LayerNorm (Megatron's --normalization). Default RMSNorm."""
    norm_epsilon: float = 1e-5
    """Norm epsilon. Default 1e-5."""
    rotary_base: float = 10000.0
    """RoPE theta. Default 10000."""
    tie_word_embeddings: bool = False
    """Share the input embedding and the output layer. Default False (Megatron's untied)."""
    init_method_std: float = 0.02
    """Std of the normal weight initialisation. Default 0.02."""
    activation: str = "swiglu"
    """Dense MLP: swiglu (gate/up/down) or gelu (fc1 -> exact GeLU -> fc2, Megatron's default MLP
    without --swiglu; ffn_hidden_size then defaults to 4h). Default swiglu."""
    add_bias_linear: bool = False
    """Biases on QKV, attention output, MLP in and out (Megatron's default; --disable-bias-linear
    turns them off). Default False."""
    position_embedding_type: str = "rope"
    """rope, learned_absolute (a table of max_position_embeddings rows added to the token embedding,
    Megatron's default) or none. Default rope."""
    apply_layernorm_1p: bool = False
    """LayerNorm gain stored as g with weight 1 + g, g initialised to 0 (--apply-layernorm-1p).
    Default False."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities (Megatron's default 0.1). Default 0."""
    hidden_dropout: float = 0.0
    """Dropout on the attention and MLP outputs before each residual add (Megatron's default 0.1).
    Default 0."""
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight).
    add_qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2; Megatron's --add-qkv-bias). Default False."""
    qk_layernorm: bool = False
    """Normalise queries and keys before RoPE (per head: Qwen3, Megatron's --qk-layernorm; over the whole
    projection: OLMoE, see qk_layernorm_scope); with multi_latent_attention: the RMSNorms of the query and
    KV latents (DeepSeek's q_a_layernorm / kv_a_layernorm, which Megatron builds only with
    --qk-layernorm). Default False."""
    qk_layernorm_scope: str = "head"
    """What qk_layernorm's q / k norms (GQA) normalise over, per token: head (each head's head_dim
    features, gains of head_dim; Qwen3, Megatron) or projection (all a*head_dim query and g*head_dim key
    features, before the split into heads, gains of that width; OLMoE; RMSNorm only, not with MLA; under
    TP the sum of squares is all-reduced over TP). Default head."""
    multi_latent_attention: bool = False
    """MLA instead of GQA. Default False."""
    q_lora_rank: int | None = None
    """MLA query compression rank; None = uncompressed queries. Default None."""
    kv_lora_rank: int = 512
    """MLA key/value compression rank. Default 512."""
    qk_head_dim: int = 128
    """MLA per-head q/k width without RoPE. Default 128."""
    qk_pos_emb_head_dim: int = 64
    """MLA per-head decoupled RoPE width. Default 64."""
    v_head_dim: int = 128
    """MLA per-head value width. Default 128."""
    # Mixture of Experts.
    num_experts: int | None = None
    """Routed experts per MoE layer; None = dense model. Default None."""
    moe_router_topk: int = 2
    """Experts each token is routed to. Default 2."""
    moe_router_score_function: str = "softmax"
    """Router scores of the logits z: softmax, sigmoid, or sqrtsoftplus (sqrt(softplus(z))).
    Default softmax."""
    moe_router_load_balancing_type: str = "aux_loss"
    """aux_loss, seq_aux_loss, sinkhorn or none. Default aux_loss."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing loss coefficient. Default 0."""
    moe_z_loss_coeff: float | None = None
    """Router z-loss coefficient; None = off. Default None."""
    moe_expert_capacity_factor: float | None = None
    """Token dropping: each expert takes at most ceil(k n / E x factor) of the n tokens one router call
    sees (Megatron-Core's capacity: a rank's tokens of one micro-batch), the rest of its assignments
    are dropped (those tokens keep their other experts and the residual); None = dropless. Default None."""
    moe_token_drop_policy: str = "probs"
    """Which assignments an over-full expert keeps: probs (the highest routing weights) or position
    (the earliest tokens, sequence position first, as Megatron's [s, b] order). Default probs."""
    moe_grouped_gemm: bool | None = None
    """All local experts in one grouped matmul per projection (torch._grouped_mm) instead of one matmul
    per expert, the same math (--moe-grouped-gemm). None: chosen per device, grouped on CUDA, the loop
    on CPU (measured faster there with one thread). Default None."""
    moe_pad_expert_input_to_capacity: bool = False
    """Every expert computes exactly its capacity of rows (zero rows fill it; static shapes, all-to-all
    splits known in advance), the same math. Needs moe_expert_capacity_factor. Default False."""
    moe_ffn_hidden_size: int | None = None
    """Routed expert FFN width. Default None = ffn_hidden_size."""
    moe_shared_expert_intermediate_size: int | None = None
    """Total width of the shared experts; None = no shared expert. Default None."""
    moe_first_k_dense_layers: int = 0
    """Leading layers that keep a dense MLP (DeepSeek's first_k_dense_replace). Default 0."""
    mtp_num_layers: int | None = None
    """Multi-token prediction depths (DeepSeek-V3's MTP modules, Megatron --mtp-num-layers): module k
    predicts token t+k+1 from the previous depth's hidden state and the embedding of token t+k, with
    one transformer layer of the model's last layer's kind, on the last pipeline stage; None = off.
    Default None."""
    mtp_loss_scaling_factor: float = 0.1
    """Weight of the MTP loss (the mean over depths) added to the LM loss for the gradient; the
    reported loss stays the LM loss. Default 0.1 (Megatron's)."""
    moe_router_pre_softmax: bool = False
    """Top-k routing weights as the scores are (softmax over all experts, then top-k; Megatron
    --moe-router-pre-softmax, HF norm_topk_prob=False); False renormalises the top-k weights to sum
    1 (Mixtral, Megatron's default). With sigmoid / sqrtsoftplus scores True keeps them unnormalised
    (HF DeepSeek-V3's norm_topk_prob=False; a Megatron command line cannot say this: Megatron-LM
    renormalises those whatever the flag, and its dialect drops it). Default False."""
    moe_router_topk_scaling_factor: float | None = None
    """Multiplies the top-k weights (DeepSeek-V3's routed_scaling_factor); None = 1. Default None."""
    moe_router_dtype: str | None = None
    """fp32 or fp64: the router's linear, scores, top-k weights and the weighted sum of the experts'
    outputs in that dtype; None = the linear in the parameters' dtype, scores in fp32, the weighted
    sum in the parameters' dtype (Megatron's unset). Default None."""
    moe_router_num_groups: int | None = None
    """Group-limited routing: experts split into this many equal groups (DeepSeek-V3's n_group);
    only with moe_router_group_topk. Default None."""
    moe_router_group_topk: int | None = None
    """Group-limited routing: each token's experts come from its best this-many groups (a group
    scores the sum of its top k/group_topk scores); None = no group limit. Default None."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing (DeepSeek-V3's e_score_correction_bias): a per-expert bias added to
    the scores for the top-k choice only, updated after every step from the step's load. Default False."""
    moe_router_bias_update_rate: float = 1e-3
    """Expert bias step per optimizer step: bias_e += rate * sign(mean load - load_e). Default 1e-3."""
    moe_router_force_load_balancing: bool = False
    """Route by random normal logits (the router's gradient passes straight through): balanced
    load whatever the weights, for benchmarks. Default False."""

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of the dense MLP: 3 for SwiGLU (gate, up, down), 2 for GeLU (fc1, fc2)."""
        return 3 if self.activation == "swiglu" else 2

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return 4 * self.hidden_size if self.activation == "gelu" else default_ffn_size(self.hidden_size)

    def padded_vocab_size(self, tp: int = 1) -> int:
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple


def default_ffn_size(hidden_size: int) -> int:
    """The SwiGLU width when ffn_hidden_size is unset: 8h/3 rounded up to a multiple of 64 (Llama)."""
    return ((8 * hidden_size // 3) + 63) // 64 * 64
