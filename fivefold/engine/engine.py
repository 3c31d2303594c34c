"""The training engine an RL framework drives (AReaL's `TrainEngine`, verl's engine, SkyRL's and RLinf's
Megatron workers): one model on one layout, fed right-padded batches of whole sequences.

    engine = Engine(config, mesh)                       # this rank's part of the model (train.loop.build)
    stats = engine.forward(batch)                       # per-token log-probs and entropy, no graph
    metrics = engine.train_batch(batch, loss_fn)        # one optimizer step on the caller's loss
    for bucket in engine.export_weights(bucket_bytes):  # HF-named full tensors, for an inference copy
        ...

A `Batch` holds token ids (n, s), right-padded, and `loss_mask` (n, s): 1 on the tokens whose
log-probability counts (the response). Position t's log-prob is log p(ids[t] | ids[<t]) (0 at t = 0), so
masks, log-probs and rollout tensors line up with the tokens. The n sequences are this rank's DP share
(`split` cuts a global batch); `loss_fn(stats, mb, scale)` returns the micro-batch's share of the loss,
where `scale` carries the global normalisation (fivefold.engine.losses.aggregate's denominator is the
global token or sequence count, which `train_batch` computes over every DP rank before the step).

Layouts: DP (replicate or ZeRO), TP with or without SP, CP, PP (any schedule; the caller's loss runs on
the last stage's rank, fivefold.pipeline.executor's `tail`) and EP. Full-vocabulary fp32 logits never
exist at once: log-probs and entropy are computed in sequence chunks of `chunk` tokens from the last
layer's hidden states, vocab-parallel under TP (fivefold.parallel.tensor.cross_entropy). Under CP each rank
computes its own positions' stats and every CP rank gets the whole sequence's
(parallel.context.context_parallel.gather_tokens, whose backward keeps each rank's own positions), so a
loss sees (n, s) tensors as without CP; the loss is then summed over DP only.

`Batch`, `TokenStats` and `split` live in fivefold.engine.batch; what stays here is the Engine itself
(forward, train_batch, memory between phases, weights out), one class read in one sitting.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from fivefold.config.schema import Config
from fivefold.engine.batch import Batch, TokenStats
from fivefold.engine.batching import plan
from fivefold.errors import NotImplementedYet
from fivefold.hf.names import hf_name
from fivefold.model.moe import moe_layers, reset_step_totals, update_expert_biases
from fivefold.parallel.context.context_parallel import gather_tokens, split_tokens
from fivefold.parallel.tensor.cross_entropy import vocab_parallel_entropy, vocab_parallel_logprobs
from fivefold.parallel.tensor.layers import TPMode, mark_sequence_sharded
from fivefold.runtime import comm
from fivefold.train.context import RankContext
from fivefold.train.moe_metrics import moe_record
from fivefold.train.step import moe_step_totals


def _add_value_head(decoder, config: Config, device: torch.device) -> None:
    h = config.model.hidden_size
    gen = torch.Generator().manual_seed(config.training.seed + 1)
    decoder.value_head = torch.nn.Linear(h, 1, bias=False)
    with torch.no_grad():
        decoder.value_head.weight.copy_(torch.randn(1, h, generator=gen) * config.model.init_method_std)
    decoder.value_head.to(device)
    if decoder.mode is TPMode.SEQUENCE_PARALLEL:  # it sees this rank's positions only
        mark_sequence_sharded(decoder.value_head)


class Engine:
    def __init__(self, config: Config, ctx: RankContext, *, chunk: int = 1024, value_head: bool = False,
                 frozen: bool = False):
        """`value_head`: a critic — a Linear(hidden, 1) on the last layer's normalised hidden states,
        replicated over TP (fed every position), trained with the model; TokenStats.values. `frozen`: a
        model that only runs `forward` (RL's reference, a reward model): its weights alone, in the run's
        parameter dtype and whole on every DP rank (no gradient buffers, main parameters or optimizer
        state: `parallelize(frozen=True)`), loaded by `sync_weights` from a trained copy; `train_batch`
        and `save` are refused."""
        from fivefold.model.decoder import build_decoder
        from fivefold.train.parallelize import parallelize
        from fivefold.pipeline.stages import build_pipeline

        self.config, self.ctx, self.chunk, self.value_head, self.frozen = config, ctx, chunk, value_head, frozen
        if ctx.layout.pp > 1:  # the stages this rank holds; any micro-batch count runs (executor_for)
            built = build_pipeline(config, ctx.mesh, 1, device=ctx.device)
            self.head_stage = built.stages.get(built.schedule.num_stages - 1)
        else:
            built = self.head_stage = build_decoder(config, ctx.mesh).to(ctx.device)
        if value_head and self.head_stage is not None:
            _add_value_head(self.head_stage, config, ctx.device)
        self.parts = parallelize(built, ctx.mesh, config, frozen=frozen)
        self.model = self.parts.model
        """The Decoder, or with PP the StageStack of this rank's stages."""

    # ---- forward ----
    def _stats(self, decoder, hidden: torch.Tensor, labels: torch.Tensor, width: int) -> torch.Tensor:
        """(n, width, 2 or 3) fp32 at each token t: log-prob, entropy and (critic) value of the
        prediction made at t - 1 (0 at t = 0), from the last layer's hidden states of this rank's
        positions (`labels` the next tokens there); differentiable when grad is on."""
        normed = decoder.final_norm(hidden)  # (n, s, h); under SP (n, s/tp, h); under CP this rank's s/cp
        head, critic = decoder.head, getattr(decoder, "value_head", None)
        values = None if critic is None else critic(normed).squeeze(-1).float()  # (n, s[/tp])
        if decoder.mode is TPMode.SEQUENCE_PARALLEL:  # gather the positions here (reduce-scatter backward):
            normed = comm.gather(normed, 1, decoder.tp, tag="engine-sp")  # the head then takes them as they are
            head = partial(F.linear, weight=decoder.head.weight)
            if values is not None:  # each rank's own positions (the head's gradient is summed over TP)
                values = comm.gather_split(values, 1, decoder.tp, tag="engine-sp")
        logps, ents = [], []
        for t0 in range(0, labels.shape[1], self.chunk):
            logits = head(normed[:, t0:t0 + self.chunk])  # (n, chunk, V_padded[/tp])
            lab = labels[:, t0:t0 + self.chunk]
            if decoder.tp is not None:
                logps.append(vocab_parallel_logprobs(logits, lab, decoder.tp, decoder.vocab_size))
                ents.append(vocab_parallel_entropy(logits, decoder.tp, decoder.vocab_size))
            else:
                logp_all = torch.log_softmax(logits[..., : decoder.vocab_size].float(), -1)
                logps.append(logp_all.gather(-1, lab.unsqueeze(-1)).squeeze(-1))
                ents.append(-(logp_all.exp() * logp_all).sum(-1))
        per_position = torch.stack([torch.cat(logps, 1), torch.cat(ents, 1)] + ([] if values is None else [values]), -1)
        if decoder.cp is not None:  # every CP rank: the whole sequence (backward: its own positions)
            per_position = gather_tokens(per_position, decoder.cp, tag="engine-cp")
        zero = per_position.new_zeros(per_position.shape[0], 1, per_position.shape[2])
        return torch.cat([zero, per_position[:, : width - 1]], 1)  # position t - 1 -> token t

    def _inputs(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (n, s[/cp]) ids and next-token labels (0 past the end: that prediction is dropped).
        A width that sequence parallelism cannot split over the TP ranks is right-padded (the causal
        attention keeps the padding out of every real token; `_stats` drops its positions)."""
        labels = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
        first = self.parts.decoders[0]
        if first.cp is None:
            pad = -ids.shape[1] % first.sequence_multiple  # TP under SP or in a MoE model, else 1
            return F.pad(ids, (0, pad)), F.pad(labels, (0, pad))
        ids, labels = split_tokens(ids, labels, first.cp, first.sequence_multiple)
        return ids, labels.clamp(min=0)  # the CP split's padding: dropped with the positions past `width`

    def _token_stats(self, ids: torch.Tensor) -> TokenStats:
        """Without PP: log-probs, entropy (and values) of every token of `ids`, differentiable."""
        local, labels = self._inputs(ids)
        return TokenStats.of(self._stats(self.model, self.model(local, head=False), labels, ids.shape[1]))

    def _tail(self, micro: list[torch.Tensor], labels: list[torch.Tensor], then=None):
        """The pipeline's last-stage computation of micro-batch mb: its token stats (the forward), or
        `then(stats, mb)` (the scaled loss, training)."""
        def tail(module, x, mb):
            stats = self._stats(module, module(x, head=False), labels[mb], micro[mb].shape[1])
            return stats if then is None else then(TokenStats.of(stats), mb)
        return tail

    def _pipeline_run(self, micro: list[torch.Tensor], mode: str, then=None):
        pipe = self.parts.pipe
        local = [self._inputs(ids) for ids in micro]
        return pipe.executor_for(len(micro)).run([ids for ids, _ in local], mode=mode,
                                                 tail=self._tail(micro, [lab for _, lab in local], then))

    @torch.no_grad()
    def forward(self, batch: Batch, micro_batch_size: int | None = None) -> TokenStats:
        """Per-token log-probs and entropy of this rank's sequences, forward-only."""
        if len(batch) == 0:  # no rows on this rank (a forward has no collective across DP ranks)
            return TokenStats.of(torch.zeros(0, batch.input_ids.shape[1], 2 + self.value_head, device=self.ctx.device))
        was = self.model.training
        self.model.train(False)
        mbs = micro_batch_size or len(batch)
        micro = [batch.input_ids[i:i + mbs] for i in range(0, len(batch), mbs)]
        if self.parts.pipe is None:
            out = [self._token_stats(ids).stacked() for ids in micro]
        else:  # the last stage's rank has them: broadcast over the pipeline group
            run, pipe, mesh = self._pipeline_run(micro, "forward"), self.parts.pipe, self.parts.mesh
            src = mesh.pp.global_rank(pipe.schedule.placement[-1])
            out = []
            for mb, ids in enumerate(micro):
                t = run.tails.get(mb)
                if t is None:
                    t = torch.empty(*ids.shape, 2 + self.value_head, dtype=torch.float32, device=self.ctx.device)
                out.append(comm.broadcast_(t.contiguous(), src, mesh.pp, tag="engine-pp"))
        self.model.train(was)
        return TokenStats.of(torch.cat(out))

    # ---- training ----
    def micro_batches(self, batch: Batch, max_tokens: int) -> list[Batch]:
        """This rank's sequences in micro-batches of at most `max_tokens` padded tokens, as many as on
        every other DP rank (fivefold.engine.batching; some may be empty), each cut to its longest."""
        lengths = batch.lengths_list()
        group = self.parts.mesh.dp  # CP and pipeline ranks of a DP rank hold the same sequences
        n = torch.tensor([len(lengths)])
        comm.all_reduce_(n, group, tag="engine-batching", op="max")
        mine = torch.tensor([lengths + [-1] * (int(n) - len(lengths))])
        every = comm.all_gather(mine, 0, group, tag="engine-batching").tolist()  # (dp, n)
        bins = plan([[x for x in row if x >= 0] for row in every], max_tokens)[group.rank]
        return [batch.rows(b, width=max((lengths[i] for i in b), default=0)) for b in bins]

    def train_batch(self, batch: Batch, loss_fn: Callable[[TokenStats, Batch, dict], torch.Tensor], *,
                    lr: float, micro_batch_size: int | None = None, max_tokens: int | None = None) -> dict:
        """One optimizer step: `loss_fn(stats, micro_batch, totals)` returns the micro-batch's share of
        the loss, dividing by the global totals it is given ({"tokens": masked tokens, "sequences":
        sequences, over every DP rank}); the loss summed over micro-batches and DP ranks is the loss of
        the whole global batch. Returns the loss, the gradient norm, `skipped` (fp16: the loss scaler found
        an inf / NaN gradient and skipped the update; the norm is then nan) and, for a MoE model, the step's load
        metrics as `fivefold train` logs them (moe_aux_loss, moe_load_imbalance, moe_dropped_fraction with
        a capacity; per layer with logging.moe_per_layer_logging), counted over every rank."""
        self._trainable("train_batch")
        dp, mesh = self.parts.dp, self.parts.mesh
        totals = torch.tensor([float(batch.loss_mask.sum()), float(len(batch))], dtype=torch.float64)
        comm.all_reduce_(totals, mesh.dp, tag="engine-totals")
        norms = {"tokens": float(totals[0]), "sequences": float(totals[1])}
        if max_tokens is not None:
            mbs_list = self.micro_batches(batch, max_tokens)
        else:  # as many on every DP rank (a rank with fewer rows runs empty ones)
            mbs = micro_batch_size or max(len(batch), 1)
            count = torch.tensor([-(-len(batch) // mbs)])
            comm.all_reduce_(count, mesh.dp, tag="engine-batching", op="max")
            mbs_list = [batch.rows(slice(i * mbs, (i + 1) * mbs)) for i in range(int(count))]
        dp.set_lr(lr)
        dp.zero_grad()
        reset_step_totals(self.parts.model)
        local = torch.zeros((), dtype=torch.float64)
        if self.parts.pipe is None:
            for i, mb in enumerate(mbs_list):
                dp.prepare(last=i == len(mbs_list) - 1)
                if len(mb) == 0:  # another DP rank has rows in this micro-batch
                    self._idle_pass()
                    continue
                loss = loss_fn(self._token_stats(mb.input_ids), mb, norms)
                (loss * dp.loss_scale).backward()
                local += loss.detach().double().cpu()
        else:  # the DP reduction runs after the schedule, so DP ranks may run different counts
            mbs_list = [mb for mb in mbs_list if len(mb)]
            self._same_count_under_ep(len(mbs_list))
            dp.prepare(last=False)
            if mbs_list:
                run = self._pipeline_run([mb.input_ids for mb in mbs_list], "train",
                                         lambda stats, i: loss_fn(stats, mbs_list[i], norms) * dp.loss_scale)
                local += sum(float(s) for s in run.loss_sums.values()) / dp.loss_scale
            self.parts.pipe.sync_tied_grads()
            comm.all_reduce_(local, mesh.pp, tag="engine-loss")  # the last stage's rank holds it
        dp.finish()
        update_expert_biases(self.parts.model, mesh.group("tp-cp-dp"))
        skipped = not dp.unscale_grads()
        norm = None if skipped else dp.clip_grads(self.config.training.clip_grad)
        if not skipped:
            dp.step()
        comm.all_reduce_(local, mesh.dp, tag="engine-loss")  # each CP rank holds its DP rank's whole loss
        out = {"loss": float(local), "grad_norm": float("nan") if norm is None else float(norm), "skipped": skipped}
        totals = moe_step_totals(self.parts)
        if totals is not None:  # the MoE load metrics `fivefold train` logs (fivefold.train.moe_metrics)
            out.update(moe_record(totals, self.parts.decoders[0].cfg, self.config.logging.moe_per_layer_logging))
        return out

    def _idle_pass(self) -> None:
        """An empty micro-batch on this DP rank (another has rows in it): one padding row's forward and
        backward with a zero loss, so that the collectives the other ranks run per micro-batch run here
        too (ZeRO-2's gradient reduce-scatter, ZeRO-3's weight gathers, the MoE expert all-to-alls; with
        `continue` ZeRO-2 aborted and ZeRO-3 and EP hung). Its gradient is zero; a MoE layer's aux-loss
        gradient is off for it and its routing counts are taken back out of the step's totals."""
        layers = moe_layers(self.model)
        kept = [(m, m.step_totals, m.aux_loss_scale) for m in layers]
        for m in layers:
            m.aux_loss_scale = 0.0
        stats = self._token_stats(torch.zeros(1, 1, dtype=torch.long, device=self.ctx.device))
        (stats.stacked().sum() * 0.0).backward()
        for m, totals, scale in kept:
            m.step_totals, m.aux_loss_scale = totals, scale

    def _same_count_under_ep(self, count: int) -> None:
        """Under PP the schedule runs only a rank's non-empty micro-batches; with expert parallelism every
        micro-batch's all-to-all spans DP ranks, so their counts must agree (else they hang): refused."""
        if self.ctx.layout.ep == 1:
            return
        counts = torch.tensor([count, -count])
        comm.all_reduce_(counts, self.parts.mesh.dp, tag="engine-batching", op="max")
        if int(counts[0]) != -int(counts[1]):
            raise NotImplementedYet(f"Engine.train_batch under pipeline and expert parallelism with DP ranks running "
                                    f"{-int(counts[1])} to {int(counts[0])} non-empty micro-batches (each expert "
                                    "all-to-all spans DP ranks): give every DP rank rows for the same micro-batch count")

    def _trainable(self, call: str) -> None:
        if self.frozen:
            raise RuntimeError(f"Engine.{call}: this engine is frozen (Engine(..., frozen=True) runs forward only, "
                               "with no gradients or optimizer state): build it without frozen to train it")

    # ---- memory between phases ----
    def _tensors(self) -> list[torch.Tensor]:
        """Every tensor the engine holds: parameters, gradient buffers and main parameters, AdamW state."""
        dp = self.parts.dp
        if dp is None:  # frozen
            return list(self.model.parameters())
        state = [t for opt in dp.optimizers for st in opt.state.values() for t in st.values()
                 if isinstance(t, torch.Tensor)]
        return list(self.model.parameters()) + dp.held_tensors() + state

    def offload(self) -> int:
        """Parameters, gradients and optimizer state to host memory, their device storage freed (set to
        0 bytes, as FSDP frees a parameter); returns the bytes moved. The engine cannot run until `onload`."""
        if getattr(self, "_host", None):
            raise RuntimeError("the engine is offloaded already")
        self._host = {}
        for t in self._tensors():
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self._host or storage.nbytes() == 0:
                continue  # shared by several views (flat buffers): moved once
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu",
                               pin_memory=storage.device.type == "cuda")
            host.untyped_storage().copy_(storage)
            self._host[key] = (storage, host)
            storage.resize_(0)
        return sum(h.numel() for _, h in self._host.values())

    def onload(self) -> None:
        """Back to the device, into the same storages (every view and optimizer reference stays valid)."""
        for storage, host in self._host.values():
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage())
        self._host = {}

    def device_bytes(self) -> int:
        """Bytes the engine's tensors hold on their device now (0 when offloaded)."""
        seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self._tensors()}
        return sum(seen.values())

    # ---- weights ----
    def whole_weights(self, writes: bool = False):
        """A context in which this rank's parameters hold their weights (ZeRO-3 frees them between uses;
        a frozen engine's are always whole): read them there (`sync_weights` from this engine); with
        `writes=True` what the block writes into them becomes this rank's ZeRO-3 chunks."""
        return nullcontext() if self.frozen else self.parts.dp.full_params(writes=writes)

    def export_weights(self, bucket_bytes: int = 512 * 2**20) -> Iterator[dict[str, torch.Tensor]]:
        """The whole model under Hugging Face names (fivefold.hf.names.hf_name), each tensor gathered whole
        from its TP / EP shards (and ZeRO-3 chunks), yielded in buckets of at most `bucket_bytes` (a
        tensor larger than that is a bucket of its own). Every rank of the model gets every bucket."""
        from fivefold.parallel.param_meta import named_metas

        if self.ctx.layout.ep > 1 or self.ctx.layout.pp > 1:  # (under PP the model is a StageStack)
            raise NotImplementedYet("export_weights with expert or pipeline parallelism (each rank holds part of "
                                    "the experts or layers): fivefold.engine.sync.sync_weights copies them")
        model, cfg = self.model, self.config.model
        bucket, size = {}, 0
        with self.whole_weights():
            metas = named_metas(model)
            for name, p in model.named_parameters():
                full = _gather_whole(p.detach(), metas[name], self.parts.mesh)
                if name == "head.weight" and cfg.tie_word_embeddings:
                    continue
                full = full[: cfg.vocab_size] if name in ("embedding.weight", "head.weight") else full
                if bucket and size + full.nbytes > bucket_bytes:
                    yield bucket
                    bucket, size = {}, 0
                bucket[hf_name(name, cfg)] = full
                size += full.nbytes
        if bucket:
            yield bucket

    def save(self, folder: str | Path, step: int) -> Path:
        from fivefold.train.loop import _save

        self._trainable("save")
        return _save(self.config, self.ctx, Path(folder), step, self.parts, None)


def _gather_whole(t: torch.Tensor, meta, mesh) -> torch.Tensor:
    """The one-process tensor from the shards of its group (uneven or replicated slices placed at their
    offsets; the same result on every rank)."""
    shard = meta.shard
    if shard is None or mesh.group(shard.group).size == 1:
        return t.clone()
    group = mesh.group(shard.group)
    width = shard.full_shape[shard.dim]  # no slice is wider
    padded = F.pad(t, [0, 0] * (t.dim() - 1 - shard.dim) + [0, width - shard.length])
    slices = comm.all_gather(padded.unsqueeze(0), 0, group, tag="engine-export")  # (tp, ...)
    starts = comm.all_gather(torch.tensor([[shard.start, shard.length]]), 0, group, tag="engine-export")
    full = torch.empty(shard.full_shape, dtype=t.dtype)
    for piece, (start, length) in zip(slices, starts.tolist()):
        full.narrow(shard.dim, start, length).copy_(piece.narrow(shard.dim, 0, length))
    return full


__all__ = ["Engine"]
