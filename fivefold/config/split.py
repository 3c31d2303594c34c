"""Decoder layers per pipeline stage, with Megatron-LM's uneven-split options.

Virtual stages are numbered as the interleaved schedule runs them: model chunk c of pipeline rank r
is virtual stage `c * pp + r`; the result has one entry per virtual stage (pp entries without VPP).

- Even split: every virtual stage gets num_layers / (pp * vpp).
- `first` / `last` (`--decoder-first/last-pipeline-num-layers`, each >= 1): pipeline rank 0 / pp-1
  hold that many layers in all; the rest are shared evenly by the middle ranks, at least one each;
  each rank spreads its layers evenly over its vpp chunks (Megatron asserts every one of these).
- `account_for_embedding` / `account_for_loss` (`--account-for-*-in-pipeline-split`): the embedding
  (loss) counts as one layer of the first (last) virtual stage, so num_layers + 1 (+ 1) is split
  evenly and that stage builds one decoder layer fewer. Not combinable with `first` / `last`.
"""
from __future__ import annotations

MAX_STAGES = 1 << 16
"""More virtual stages than this are refused rather than listed (a typo'd PP must not fill memory)."""


def layers_per_stage(num_layers: int, pp: int, vpp: int | None = None, first: int | None = None,
                     last: int | None = None, account_for_embedding: bool = False,
                     account_for_loss: bool = False) -> list[int]:
    """Decoder layers of each virtual stage (index chunk * pp + rank); ValueError names the broken rule."""
    v = vpp or 1
    if num_layers < 1 or pp < 1 or v < 1:
        raise ValueError(f"num_layers={num_layers}, pp={pp}, vpp={v} must all be >= 1")
    if pp * v > MAX_STAGES:
        raise ValueError(f"pp*vpp = {pp}*{v} = {pp * v} virtual stages: fivefold lays out at most {MAX_STAGES}")
    if (first is not None or last is not None) and (account_for_embedding or account_for_loss):
        raise ValueError("decoder_first/last_pipeline_num_layers cannot be combined with "
                         "account_for_embedding/loss_in_pipeline_split (Megatron refuses both)")
    if first is not None or last is not None:
        return _uneven(num_layers, pp, v, first, last)
    units = num_layers + int(account_for_embedding) + int(account_for_loss)
    chunks = pp * v
    if units % chunks:
        extra = ("" if units == num_layers else
                 f" (num_layers={num_layers} + {units - num_layers} for embedding/loss = {units})")
        raise ValueError(f"{units} layers{extra} do not split evenly into pp*vpp={pp}*{v}={chunks} stages")
    out = [units // chunks] * chunks
    out[0] -= int(account_for_embedding)
    out[-1] -= int(account_for_loss)
    if min(out) < 0:
        raise ValueError(f"{num_layers} layers leave no room for the embedding/loss on {chunks} stages")
    return out


def _uneven(num_layers: int, pp: int, v: int, first: int | None, last: int | None) -> list[int]:
    if pp < 2:
        raise ValueError("decoder_first/last_pipeline_num_layers need pipeline_model_parallel_size > 1")
    if min(n for n in (first, last, 1) if n is not None) < 1:
        raise ValueError(f"first={first} and last={last}: a stage given a layer count needs >= 1 (Megatron-Core)")
    per_rank: dict[int, int] = {}
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[pp - 1] = last
    middle = [r for r in range(pp) if r not in per_rank]
    rest = num_layers - sum(per_rank.values())
    if rest < 0 or bool(middle) != bool(rest) or (middle and rest % len(middle)):
        raise ValueError(f"after first={first} and last={last}, {rest} layers remain for the "
                         f"{len(middle)} middle stage(s): they must split evenly, at least one layer "
                         "each (Megatron-Core)")
    for r in middle:
        per_rank[r] = rest // len(middle)
    for r, n in per_rank.items():
        if n % v:
            raise ValueError(f"pipeline rank {r} holds {n} layers, not divisible by vpp={v} chunks")
    return [per_rank[i % pp] // v for i in range(pp * v)]
