"""Sampling from the decoder with a key/value cache, one model replica (TP ranks together), forward-only.

    tokens, logprobs = generate(model, prompts, max_new_tokens, temperature=1.0, seed=0)

The prompts (b, s0) are run once (prefill), filling every layer's cache with this rank's heads'
keys and values; then each step feeds the b newest tokens only: their queries attend to the cached
positions and themselves (fivefold.ops.attention.cached_attention), RoPE at their true positions.
Under tensor parallelism every rank holds its heads' cache and its vocabulary slice of the logits;
the slices are gathered, so every TP rank samples the same token from the same seeded generator.
`temperature` 0 is greedy. Returns the sampled tokens (b, n) and their log-probabilities under the
sampling distribution's model (temperature 1: the model's own log-probs, what an RL trainer's
"rollout log-probs" are).

This is the toy engine the RL demo needs; a real framework drives vLLM / SGLang instead. Not built:
MLA, context / sequence / pipeline / expert parallelism in generation (refused), prompts of
different lengths (pad them to one length on the left of the text, e.g. with a fixed format).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fivefold.errors import NotImplementedYet
from fivefold.model.decoder import Decoder
from fivefold.parallel.tensor.layers import TPMode
from fivefold.runtime import comm


@dataclass
class KVCache:
    """Every layer's [k, v] of the positions run so far (this rank's heads)."""
    layers: list[list]
    length: int = 0

    @classmethod
    def empty(cls, model: Decoder) -> KVCache:
        return cls([[] for _ in model.layers])


@dataclass
class Generated:
    tokens: torch.Tensor
    """(b, n) sampled token ids."""
    logprobs: torch.Tensor
    """(b, n) fp32 log p(token) under the model (before temperature)."""
    cache: KVCache = field(repr=False, default=None)


def model_features_not_generated(cfg) -> list[str]:
    """What of a model's architecture (a ModelConfig) generation has not built: checked before
    `fivefold rl` starts its ranks, and by `check_generates`."""
    return [what for what, bad in (("multi-latent attention", cfg.multi_latent_attention), ("MoE", cfg.is_moe)) if bad]


def check_generates(model: Decoder) -> None:
    why = model_features_not_generated(model.cfg) + [
        what for what, bad in (("context parallelism", model.cp is not None and model.cp.size > 1),
                               ("sequence parallelism", model.mode is TPMode.SEQUENCE_PARALLEL),
                               ("a pipeline stage", not (model.has_embedding and model.has_head))) if bad]
    if why:
        raise NotImplementedYet(f"generation with {', '.join(why)} (it runs one dense GQA model replica, TP allowed)")


def _vocab_logits(model: Decoder, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """fp32 logits (b, V) of the last position, the TP slices gathered."""
    logits = model(ids, cache=cache)[:, -1]  # (b, V_padded[/tp])
    if model.tp is not None and model.tp.size > 1:
        logits = comm.gather(logits.contiguous(), -1, model.tp, tag="generate")
    return logits[:, : model.vocab_size].float()


@torch.no_grad()
def generate(model: Decoder, prompts: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             seed: int = 0) -> Generated:
    check_generates(model)
    was_training = model.training
    model.eval()
    gen = torch.Generator(device=prompts.device).manual_seed(seed)
    cache = KVCache.empty(model)
    logits = _vocab_logits(model, prompts, cache)
    tokens, logps = [], []
    for step in range(max_new_tokens):
        logp = torch.log_softmax(logits, dim=-1)  # (b, V)
        if temperature == 0:
            nxt = logp.argmax(-1)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)  # (b,)
        tokens.append(nxt)
        logps.append(logp.gather(-1, nxt[:, None]).squeeze(-1))
        if step + 1 < max_new_tokens:
            logits = _vocab_logits(model, nxt[:, None], cache)
    model.train(was_training)
    return Generated(torch.stack(tokens, 1), torch.stack(logps, 1), cache)
