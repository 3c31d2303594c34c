"""The Llama-style decoder: embedding -> pre-norm layers (GQA or MLA attention + SwiGLU; RMSNorm or
LayerNorm) -> norm -> output.

A Decoder may hold any subset of the model (a pipeline stage): `layers` are global layer indices
(parameter names keep them: `layers.5.attn.q_proj.weight`), `embedding`/`head` say whether the
stage owns the input embedding and the final norm + output layer. With tie_word_embeddings the
output layer reuses embedding.weight; on a stage that has the head but not the embedding it holds
its own copy, initialised to the same value (keeping the copies in sync is the pipeline's job).
With multi-token prediction (model.mtp_num_layers, fivefold.model.mtp) the stage with the head also
holds the MTP modules, and the input embedding they share (a copy on a last stage without it).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config.schema import QK_NORM_SCOPES, ModelConfig
from fivefold.errors import NotImplementedYet, UserError
from fivefold.model.block import DecoderLayer, rotary_dim
from fivefold.model.init import init_buffers_, init_parameters_
from fivefold.model.moe import MoEGroups, check_moe_supported, set_aux_loss_scale
from fivefold.model.mtp import AttachLoss, MTPLayer, check_mtp_supported, rolled_targets, token_losses
from fivefold.model.dropout import EMBEDDING, DropoutKey, Noise, dropped
from fivefold.model.norm import make_norm
from fivefold.model.positions import check_positions_supported, learned_positions
from fivefold.model.recompute import Recompute, maybe_checkpoint
from fivefold.model.rope import rope_tables
from fivefold.parallel.context.context_parallel import local_document_positions, local_positions
from fivefold.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from fivefold.parallel.param_meta import mark_all
from fivefold.parallel.tensor.layers import ColumnParallelLinear, TPMode, VocabParallelEmbedding, mark_sequence_sharded


def _check_supported(cfg: ModelConfig) -> None:
    if cfg.is_moe:
        check_moe_supported(cfg)
    check_positions_supported(cfg)
    check_mtp_supported(cfg)
    if cfg.multi_latent_attention and (cfg.add_bias_linear or cfg.add_qkv_bias):
        raise NotImplementedYet("model.add_bias_linear / add_qkv_bias with multi_latent_attention: MLA's "
                                "projections are built without biases (not implemented yet)")
    if cfg.qk_layernorm_scope not in QK_NORM_SCOPES:
        raise UserError(f"model.qk_layernorm_scope={cfg.qk_layernorm_scope!r} is not one of "
                        f"{', '.join(QK_NORM_SCOPES)} (try head)")
    if cfg.qk_layernorm_scope == "projection" and (cfg.multi_latent_attention or cfg.normalization != "RMSNorm"):
        what = "multi_latent_attention" if cfg.multi_latent_attention else f"normalization={cfg.normalization!r}"
        raise UserError(f"model.qk_layernorm_scope='projection' with {what}: q / k norms over the whole "
                        "projection are OLMoE's RMSNorms over GQA's q and k (use qk_layernorm_scope head)")
    if not cfg.multi_latent_attention and cfg.num_attention_heads % cfg.kv_heads:
        raise UserError(f"num_attention_heads={cfg.num_attention_heads} must be a multiple of "
                        f"num_query_groups={cfg.kv_heads}")


class Decoder(nn.Module):
    """ids (b, s) -> logits (b, s, V_padded); see the module docstring for pipeline stages."""

    def __init__(self, cfg: ModelConfig, *, mesh=None, layers: Sequence[int] | None = None,
                 embedding: bool = True, head: bool = True, seed: int = 0, sequence_parallel: bool = False):
        """With `mesh.tp` of > 1 rank the layers are tensor-parallel (fivefold.parallel.tensor.layers), the
        vocabulary is padded to a multiple of 128 x TP and split over TP, and `sequence_parallel`
        keeps the residual stream as (b, s/tp, h). Every TP parameter is the slice of the
        one-process parameter of the same name (its ParamMeta's `shard`), so all layouts start equal."""
        super().__init__()
        _check_supported(cfg)
        tp = mesh.tp if mesh is not None and mesh.tp.size > 1 else None
        mode = TPMode.of(sequence_parallel and tp is not None)
        self.tp, self.mode = tp, mode
        ids = list(range(cfg.num_layers)) if layers is None else [int(i) for i in layers]
        if any(not 0 <= i < cfg.num_layers for i in ids) or ids != sorted(set(ids)):
            raise UserError(f"Decoder layers={ids}: need increasing indices in 0..{cfg.num_layers - 1}")
        self.cfg, self.seed, self.layer_ids = cfg, seed, ids
        self.has_embedding, self.has_head = embedding, head
        self.vocab_size = cfg.vocab_size
        self.padded_vocab_size = cfg.padded_vocab_size(tp.size if tp else 1)
        h, vp = cfg.hidden_size, self.padded_vocab_size
        mtp = head and bool(cfg.mtp_num_layers)
        with torch.device("meta"):  # no throw-away default init; values come from init_parameters_
            if tp is None:
                self.embedding = nn.Embedding(vp, h) if embedding or mtp else None
                self.head = nn.Linear(h, vp, bias=False) if head else None
            else:
                self.embedding = VocabParallelEmbedding(vp, h, group=tp, mode=mode) if embedding or mtp else None
                self.head = ColumnParallelLinear(h, vp, group=tp, mode=mode) if head else None
            moe = MoEGroups.of(mesh) if cfg.is_moe else None
            self.position_embedding = learned_positions(cfg, tp, mode) if embedding else None
            self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, tp, mode, layer=i, moe=moe) for i in ids})
            self.final_norm = make_norm(cfg, h) if head else None
            self.mtp = nn.ModuleList([MTPLayer(cfg, tp, mode, depth=k, moe=moe)
                                      for k in range(1, cfg.mtp_num_layers + 1)]) if mtp else None
        if head and mode is TPMode.SEQUENCE_PARALLEL:
            mark_sequence_sharded(self.final_norm)
        for m in (self.embedding, self.head):
            if m is not None:  # rows past the vocabulary are padding: checkpoints may pad otherwise
                mark_all(m, vocab_rows=cfg.vocab_size)
        self.to_empty(device="cpu")  # parameter metadata lives on the modules: it survives this
        aliases = {}
        if head and cfg.tie_word_embeddings:
            if self.embedding is not None:
                self.head.weight = self.embedding.weight
            else:
                aliases["head.weight"] = "embedding.weight"
        init_parameters_(self, seed=seed, std=cfg.init_method_std, vocab_size=cfg.vocab_size, aliases=aliases)
        init_buffers_(self)
        self.cp = None
        """Context parallelism, set by fivefold.train.parallelize (apply_context_parallel): ids are
        then this CP rank's s/cp tokens (parallel.context.context_parallel.split_tokens)."""
        self.recompute = Recompute()
        self.mtp_loss_sums: torch.Tensor | None = None
        """With MTP: (mtp_num_layers,) float64, depth k's token-loss sum over this rank's tokens in the
        last `loss` call (unscaled; for the metrics)."""

    def set_recompute(self, recompute: Recompute) -> None:
        """Activation recompute from now on (fivefold.model.recompute: full spans of layers, or the
        core attention of every layer, MTP's included, as Megatron's attention reads it from the
        config every layer shares); Recompute() turns it off."""
        self.recompute = recompute
        for layer in [*self.layers.values(), *(d.layer for d in self.mtp or ())]:
            layer.attn.recompute_core = recompute.core_attention

    def _positions(self, s: int, device, docs) -> torch.Tensor:
        """This rank's RoPE positions: (s,) 0..s-1 (or its CP chunks), or per row (b, s) restarting
        at each document with packed documents' reset_position_ids (fivefold.data.documents)."""
        n, r = (1, 0) if self.cp is None else (self.cp.size, self.cp.rank)
        if docs is not None and docs.positions is not None:
            return local_document_positions(docs.positions, s, n, r).to(device)
        return torch.arange(s, device=device) if n == 1 else local_positions(s, n, r, device)

    def _noise(self, key: DropoutKey | None, s: int, device) -> Noise | None:
        """This forward's dropout (training with a key and a rate > 0), with the global positions of
        this rank's tokens: its CP chunks, and of the residual stream its SP slice."""
        cfg = self.cfg
        if key is None or not self.training or not (cfg.hidden_dropout or cfg.attention_dropout):
            return None
        n, r = (1, 0) if self.cp is None else (self.cp.size, self.cp.rank)
        positions = torch.arange(s, device=device) if n == 1 else local_positions(s, n, r, device)  # (s,)
        rows = positions
        if self.mode is TPMode.SEQUENCE_PARALLEL:
            part = s // self.tp.size
            rows = positions[self.tp.rank * part:(self.tp.rank + 1) * part]  # (s/tp,)
        return Noise(self.seed, key, cfg.hidden_dropout, cfg.attention_dropout, positions, rows)

    def _attention_inputs(self, positions: torch.Tensor, s: int, docs):
        """(cos, sin, document bounds) every layer's attention takes for this rank's s tokens."""
        cos = sin = None  # learned_absolute / none: attention applies no rotation
        if self.cfg.position_embedding_type == "rope":
            cos, sin = rope_tables(positions, rotary_dim(self.cfg), self.cfg.rotary_base)  # ([b,] s, d)
        bounds = None if docs is None or docs.attention is None else \
            docs.attention.padded_to(s * (1 if self.cp is None else self.cp.size))
        return cos, sin, bounds

    def forward(self, x: torch.Tensor, docs=None, noise: DropoutKey | None = None, cache=None,
                head: bool = True) -> torch.Tensor:
        """x: ids (b, s) with an embedding, else hidden (b, s, h). Returns logits (b, s, V_padded)
        with a head (padded columns are 0: their rows are zero), else hidden (b, s, h).
        Context-parallel: s is this CP rank's s/cp tokens (parallel.context.context_parallel.split_tokens: chunks r and
        2cp-1-r), whose RoPE positions the Decoder derives from its CP rank.
        Tensor-parallel: logits are this rank's vocabulary slice (b, s, V_padded/tp); under sequence
        parallelism hidden states in and out are this rank's (b, s/tp, h).
        `docs` (fivefold.data.documents.PackedDocs of the whole batch, or None): packed documents,
        each attending to itself and/or with RoPE positions restarting per document.
        `noise` (training): the micro-batch's dropout key (fivefold.model.dropout); None = no dropout.
        `cache` (generation, fivefold.model.generate.KVCache): x continues the cached positions.
        `head` False: the last layer's hidden states, for `head_logits` on chunks of them."""
        sp = self.mode is TPMode.SEQUENCE_PARALLEL
        s = x.shape[1] * (self.tp.size if sp and not self.has_embedding else 1)  # this CP rank's s/cp
        hidden = self.embedding(x) if self.has_embedding else x  # (b, s/cp, h) or (b, s/cp/tp, h)
        positions = self._positions(s, hidden.device, docs)  # (s,) or (b, s)
        if cache is not None:
            positions = positions + cache.length
        if self.position_embedding is not None:
            hidden = hidden + self.position_embedding(positions)  # (b, s, h) or (b, s/tp, h)
        drop = self._noise(noise, s, hidden.device)
        if self.has_embedding:
            hidden = dropped(drop, hidden, -1, EMBEDDING)  # Megatron's embedding dropout (hidden_dropout)
        cos, sin, bounds = self._attention_inputs(positions, s, docs)
        layers = list(self.layers.values())
        if cache is not None:  # generation: forward-only, each layer extends its keys and values
            for i, layer in enumerate(layers):
                hidden = layer(hidden, cos, sin, cache=cache.layers[i])
            cache.length += s
            return self.head(self.final_norm(hidden))
        for start, end, recompute in self.recompute.spans(len(layers)):
            def span(x, chunk=layers[start:end]):
                for layer in chunk:
                    x = layer(x, cos, sin, bounds, drop)  # (b, s, h)
                return x
            hidden = maybe_checkpoint(span, recompute, hidden)  # (b, s, h)
        if not self.has_head or not head:
            return hidden
        return self.head(self.final_norm(hidden))  # (b, s, V_padded)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer on the last layer's hidden states (forward(x, head=False)): (b, s, V_padded[/tp])."""
        return self.head(self.final_norm(hidden))

    def hidden_shape(self, ids_shape: Sequence[int]) -> tuple[int, int, int]:
        """Shape of the hidden states between layers (a pipeline stage boundary) for token ids of
        `ids_shape` (b, s): (b, s/tp, h) under sequence parallelism, else (b, s, h). Under context
        parallelism the ids are already this rank's (b, s/cp), so s here is s/cp."""
        b, s = ids_shape
        return (b, s // self.tp.size if self.mode is TPMode.SEQUENCE_PARALLEL else s, self.cfg.hidden_size)

    @property
    def sequence_multiple(self) -> int:
        """What this rank's share of a sequence must divide by: TP under sequence parallelism or in a MoE
        model (its MoE layers split the tokens over TP without SP too, fivefold.model.moe), else 1 (the
        CP split pads a batch to 2*CP times this, parallel.context.context_parallel.split_tokens)."""
        split = self.mode is TPMode.SEQUENCE_PARALLEL or (self.cfg.is_moe and self.tp is not None)
        return self.tp.size if split else 1

    def _head_logits(self, x: torch.Tensor, docs=None, noise=None) -> torch.Tensor:
        """This TP rank's (b, s, V_padded/tp) logits; the full vocabulary is never gathered."""
        if not self.has_head:
            raise UserError("Decoder.loss/logprobs need the output layer (head=True)")
        return self.forward(x, docs, noise)

    def _vocab_logits(self, x: torch.Tensor, docs=None, noise=None) -> torch.Tensor:
        """fp32 logits over the real vocabulary (b, s, V). Dropping the padded columns is the same as
        masking them to -inf: exp(-inf) = 0 adds nothing to the softmax and they get no gradient."""
        if not self.has_head:
            raise UserError("Decoder.loss/logprobs need the output layer (head=True)")
        return self.forward(x, docs, noise)[..., : self.vocab_size].float()

    def loss(self, x: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, docs=None, noise=None,
             input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum over target tokens of -log p(label) in fp32, number of target tokens): tokens whose
        label is ignore_index count in neither. The caller divides by the global token count.
        With MTP the sum's gradient also trains the MTP loss (fivefold.model.mtp; its value is not
        in the sum); a last pipeline stage (x hidden states) then needs this rank's `input_ids`."""
        if self.mtp is not None:
            return self._loss_with_mtp(x, labels, ignore_index, docs, noise, input_ids)
        if self.tp is not None:
            losses, _ = vocab_parallel_cross_entropy(self._head_logits(x, docs, noise), labels, self.tp,
                                                     self.vocab_size, ignore_index)
            return losses.sum(), (labels != ignore_index).sum()
        logits = self._vocab_logits(x, docs, noise)  # (b, s, V)
        total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=ignore_index, reduction="sum")
        return total, (labels != ignore_index).sum()

    def _loss_with_mtp(self, x, labels, ignore_index, docs, noise, input_ids):
        if docs is not None:
            raise NotImplementedYet("model.mtp_num_layers with packed documents (data.reset_attention_mask / "
                                    "reset_position_ids): the roll would cross documents (not implemented yet)")
        ids = x if self.has_embedding else input_ids
        if ids is None:
            raise UserError("Decoder.loss with MTP on a stage without the input embedding needs input_ids")
        hidden = self.forward(x, docs, noise, head=False)  # h^0: (b, s, h) or (b, s/tp, h) under SP
        total = token_losses(self.head_logits(hidden), labels, self.tp, self.vocab_size, ignore_index)
        s = ids.shape[1]  # this CP rank's s/cp
        cos, sin, bounds = self._attention_inputs(self._positions(s, hidden.device, docs), s, docs)  # the main layers'
        drop = self._noise(noise, s, hidden.device)
        sums = []
        for layer, (ids_k, labels_k) in zip(self.mtp, rolled_targets(ids, labels, len(self.mtp), self.cp)):
            emb = dropped(drop, self.embedding(ids_k), layer.layer.layer, EMBEDDING)  # Emb(x_{t+k}): (b, s', h)
            hidden, normed = layer(hidden, emb, cos, sin, bounds, drop)  # h^k, final_norm(h^k)
            sums.append(token_losses(self.head(normed), labels_k, self.tp, self.vocab_size, ignore_index))
        mtp = torch.stack(sums)  # (D,) fp32
        self.mtp_loss_sums = mtp.detach().double()
        scale = self.cfg.mtp_loss_scaling_factor / len(self.mtp)
        return AttachLoss.apply(total, mtp.sum() * scale), (labels != ignore_index).sum()

    def logprobs(self, x: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, docs=None) -> torch.Tensor:
        """Per-token log p(label) (b, s) in fp32; 0 where label == ignore_index."""
        if self.tp is not None:
            _, logp = vocab_parallel_cross_entropy(self._head_logits(x, docs), labels, self.tp, self.vocab_size,
                                                   ignore_index)
            return logp
        logp = torch.log_softmax(self._vocab_logits(x, docs), dim=-1)  # (b, s, V)
        keep = labels != ignore_index
        picked = logp.gather(-1, torch.where(keep, labels, 0).unsqueeze(-1)).squeeze(-1)  # (b, s)
        return picked * keep


def build_decoder(config, mesh, *, layers: Sequence[int] | None = None, embedding: bool = True,
                  head: bool = True, seed: int | None = None) -> Decoder:
    """The model (or, with `layers`/`embedding`/`head`, the pipeline stage) a training run of
    `config` builds on this rank of `mesh`: the one place that maps the run's config onto Decoder's
    arguments (TP from the mesh, sequence parallelism, the seed)."""
    model = Decoder(config.model, mesh=mesh, layers=layers, embedding=embedding, head=head,
                    seed=config.training.seed if seed is None else seed,
                    sequence_parallel=config.parallel.sequence_parallel)
    t = config.training
    if config.model.is_moe and t.global_batch_size:  # the aux loss is a mean over the step's micro-batches
        set_aux_loss_scale(model, t.micro_batch_size / t.global_batch_size)
    return model
