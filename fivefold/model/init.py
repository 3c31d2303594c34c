"""Deterministic initialisation: each parameter's value is a function of (seed, its full name) only.

So Decoder(cfg, layers=[2, 3]) holds bit-exactly the weights of layers 2 and 3 of Decoder(cfg), and
a tensor-parallel shard can be cut from `initial_value(...)` of the full weight. Rules:
  norm gains: ones (zeros when stored zero-centred, --apply-layernorm-1p);  biases: zeros;  every other weight: normal(0, init_method_std)
  from a torch.Generator seeded by sha256(f"{seed}/{name}");  vocabulary matrices: the real vocab_size rows are drawn, padded rows
  are zero (so the draw does not depend on the padding, hence not on TP).
Buffers (the MoE router's expert bias and load counts) start at zero: `init_buffers_`, after the
model is materialised from the meta device (`to_empty` leaves them uninitialised).
"""
from __future__ import annotations

import hashlib

import torch
from torch import nn

from fivefold.parallel.param_meta import named_metas

VOCAB_PARAMS = ("embedding.weight", "head.weight")
"""Parameters whose rows are the (padded) vocabulary."""


def name_seed(seed: int, name: str) -> int:
    """A stable 63-bit generator seed for (seed, parameter name) — unlike hash(), the same in every process."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def initial_value(name: str, shape: tuple[int, ...], *, seed: int, std: float, vocab_size: int,
                  zero_centered: bool = False) -> torch.Tensor:
    """The full fp32 initial value of parameter `name` (its name in the one-process Decoder);
    `zero_centered`: a norm gain stored as w - 1."""
    if name.endswith("norm.weight"):
        return torch.zeros(shape) if zero_centered else torch.ones(shape)
    if name.endswith(".bias"):  # norm and linear biases (Megatron zero-initialises both)
        return torch.zeros(shape)
    rows = min(vocab_size, shape[0]) if name in VOCAB_PARAMS else shape[0]
    gen = torch.Generator().manual_seed(name_seed(seed, name))
    value = torch.zeros(shape)
    value[:rows] = torch.empty((rows, *shape[1:])).normal_(0.0, std, generator=gen)
    return value


@torch.no_grad()
def init_parameters_(model: nn.Module, *, seed: int, std: float, vocab_size: int,
                     aliases: dict[str, str] | None = None) -> None:
    """Fill every parameter of `model` in place. `aliases` maps a local name to the name whose value
    it must hold (a tied output layer on the last pipeline stage holds 'embedding.weight')."""
    aliases = aliases or {}
    metas = named_metas(model)
    zero_centered = {f"{n}.weight" for n, m in model.named_modules() if getattr(m, "zero_centered", False)}
    for name, p in model.named_parameters():
        key = aliases.get(name, name)
        spec = metas[name].shard  # a tensor-parallel shard: cut from the full value
        full = initial_value(key, spec.full_shape if spec else tuple(p.shape), seed=seed, std=std, vocab_size=vocab_size,
                             zero_centered=name in zero_centered)
        p.copy_(spec.of(full) if spec else full)


@torch.no_grad()
def init_buffers_(model: nn.Module) -> None:
    """Zero every buffer of `model` (each one fivefold registers starts at zero)."""
    for b in model.buffers():
        b.zero_()
