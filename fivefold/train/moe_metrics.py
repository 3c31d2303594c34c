"""MoE load metrics of a training step, and the expert-load heatmap.

From the step's per-layer totals (fivefold.model.moe.layer_totals, summed over every rank, so every
layout logs the same numbers), a metrics.jsonl line gets:

  moe_aux_loss          aux + z loss summed over MoE layers, mean over the step's micro-batches
  moe_load_imbalance    the worst MoE layer's max_e load_e / mean_e load_e (1 = balanced; at most E)
  moe_dropped_fraction  with a capacity factor: assignments dropped / made, all layers

and with logging.moe_per_layer_logging (Megatron's --moe-per-layer-logging) the same per MoE layer,
keyed by its global layer index:

  moe_tokens_per_expert           {layer: [load_e]}  assignments each expert took over the step,
                                                     after token dropping (k per kept token)
  moe_load_imbalance_per_layer    {layer: max / mean}
  moe_aux_loss_per_layer          {layer: aux + z loss}
  moe_dropped_fraction_per_layer  {layer: dropped / made}  (capacity factor only)

`plot_expert_load` draws moe_tokens_per_expert over the steps of a metrics.jsonl as a heatmap PNG:
one row per (layer, expert), one column per logged step, the colour the expert's load over the mean.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from fivefold.config.schema import ModelConfig
from fivefold.model.moe import is_moe_layer

AUX, DROPPED, MADE, LOAD = 0, 1, 2, 3
"""Columns of layer_totals: the aux term, assignments dropped, assignments made, then one per expert."""


def imbalance(load: torch.Tensor) -> torch.Tensor:
    """max_e / mean_e of the last dimension (1 where nothing was routed)."""
    mean = load.mean(-1)
    return torch.where(mean > 0, load.max(-1).values / mean.clamp(min=1e-300), torch.ones_like(mean))


def moe_record(totals: torch.Tensor, cfg: ModelConfig, per_layer: bool) -> dict:
    """The metrics.jsonl fields of one step from its (layers, 3 + E) totals summed over every rank."""
    layers = [l for l in range(totals.shape[0]) if is_moe_layer(cfg, l)]
    rows = totals[layers]  # (L_moe, 3 + E)
    capacity = cfg.moe_expert_capacity_factor is not None
    rec: dict = {"moe_aux_loss": float(rows[:, AUX].sum())}
    ratio = imbalance(rows[:, LOAD:])  # (L_moe,)
    rec["moe_load_imbalance"] = float(ratio.max()) if layers else 1.0
    if capacity:
        rec["moe_dropped_fraction"] = float(rows[:, DROPPED].sum() / rows[:, MADE].sum().clamp(min=1))
    if per_layer:
        keys = [str(l) for l in layers]
        rec["moe_tokens_per_expert"] = {k: [int(v) for v in row[LOAD:]] for k, row in zip(keys, rows)}
        rec["moe_load_imbalance_per_layer"] = {k: float(v) for k, v in zip(keys, ratio)}
        rec["moe_aux_loss_per_layer"] = {k: float(row[AUX]) for k, row in zip(keys, rows)}
        if capacity:
            rec["moe_dropped_fraction_per_layer"] = {
                k: float(row[DROPPED] / row[MADE].clamp(min=1)) for k, row in zip(keys, rows)}
    return rec


def plot_expert_load(rows: list[dict], png_path: str | Path, title: str = "") -> Path | None:
    """The heatmap of `rows` (metrics.jsonl lines) that carry moe_tokens_per_expert, or None when none
    does (per-layer logging off). Colour: load_e / mean load of its layer and step, on a log scale
    centred at 1 (balanced); white lines separate the layers."""
    rows = [r for r in rows if r.get("moe_tokens_per_expert")]
    if not rows:
        return None
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    layers = sorted(rows[0]["moe_tokens_per_expert"], key=int)
    loads = torch.tensor([[r["moe_tokens_per_expert"][k] for k in layers] for r in rows],
                         dtype=torch.float64)  # (steps, L_moe, E)
    steps, n_layers, n_experts = loads.shape
    share = loads / loads.mean(-1, keepdim=True).clamp(min=1e-300)  # (steps, L_moe, E): 1 = the mean
    grid = share.permute(1, 2, 0).reshape(n_layers * n_experts, steps).clamp(min=1e-2)  # rows (layer, expert)
    top = max(float(grid.max()), 1.0 / float(grid.min()), 1.01)
    fig, ax = plt.subplots(figsize=(min(14, 4 + 0.08 * steps), min(12, 2 + 0.12 * n_layers * n_experts)))
    image = ax.imshow(grid.numpy(), aspect="auto", interpolation="nearest", cmap="RdBu_r",
                      norm=LogNorm(vmin=1 / top, vmax=top),
                      extent=(rows[0]["step"] - 0.5, rows[-1]["step"] + 0.5, n_layers * n_experts - 0.5, -0.5))
    for i in range(1, n_layers):
        ax.axhline(i * n_experts - 0.5, color="white", linewidth=1.5)
    ax.set_yticks([i * n_experts + (n_experts - 1) / 2 for i in range(n_layers)], [f"layer {k}" for k in layers])
    ax.set_xlabel(f"step ({n_experts} experts per layer, expert 0 at the top)")
    ax.set_title(title or "expert load / mean load (tokens per expert)")
    fig.colorbar(image, ax=ax, label="load / mean")
    fig.tight_layout()
    from fivefold.train.metrics import save_figure
    save_figure(fig, png_path, "the expert-load picture; metrics.jsonl holds the numbers", dpi=100)
    return Path(png_path)
