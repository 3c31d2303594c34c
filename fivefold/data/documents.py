"""Packed documents: which tokens of a packed sequence belong together, from its end-of-document tokens.

Megatron's rules (`get_ltor_masks_and_position_ids`), for input ids (b, s) and the EOD token id:
a document ends with its EOD token, and the token after an EOD starts the next one.
  reset_attention_mask  each document attends only to itself (`Documents`, the boundaries every
                        attention layer and every CP mode honours: fivefold.ops.attention);
  reset_position_ids    RoPE positions restart at 0 at each document start;
  eod_mask_loss         the prediction made *at* an EOD token (the next document's first token, from
                        nothing of it) gets no loss; the loss is the mean over the remaining targets.
Boundaries are computed once per microbatch from the whole sequence, before the CP split, and
travel with the microbatch (`Microbatch.docs`) to every rank and pipeline stage.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from fivefold.errors import UserError
from fivefold.ops.attention import Documents


@dataclass(frozen=True)
class DocumentRules:
    """The data config's packing flags and the tokenizer's end-of-document id."""

    eod_id: int
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    @staticmethod
    def of(data_config, eod_id: int) -> DocumentRules | None:
        """None when no flag is on (the batch is one causal sequence per row, as before)."""
        d = data_config
        if not (d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss):
            return None
        return DocumentRules(eod_id, d.reset_position_ids, d.reset_attention_mask, d.eod_mask_loss)


def document_rules(data_config, data_dir: Path) -> DocumentRules | None:
    """The run's rules, with the EOD id of the prepared data (its meta.json). A pre-tokenized token
    file read with the byte tokenizer has no known EOD id: refused rather than cut at token 0."""
    meta = json.loads((data_dir / "meta.json").read_text())
    rules = DocumentRules.of(data_config, meta["eod_id"])
    if rules is not None and meta["kind"] in ("tokens", "indexed") and data_config.tokenizer == "byte":
        raise UserError(f"data.reset_position_ids / reset_attention_mask / eod_mask_loss need the end-of-document "
                        f"id of the tokenizer that wrote {data_config.path}: set data.tokenizer to that Hugging "
                        "Face tokenizer's folder (its EOS id is used), or turn the three flags off")
    return rules


@dataclass(frozen=True)
class PackedDocs:
    """What a microbatch's documents change in the model."""

    attention: Documents | None
    """Document boundaries of the whole (b, s) batch, or None (one causal sequence per row)."""
    positions: torch.Tensor | None
    """(b, s) RoPE positions restarting per document, or None (0..s-1)."""


def document_starts(ids: torch.Tensor, eod_id: int) -> torch.Tensor:
    """(b, s) bool: True at position 0 and after every EOD token."""
    starts = torch.zeros_like(ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = ids[:, :-1] == eod_id
    return starts


def document_positions(starts: torch.Tensor) -> torch.Tensor:
    """(b, s) positions counted from the latest document start."""
    idx = torch.arange(starts.shape[1]).expand_as(starts)
    last_start = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - last_start


def packed_docs(ids: torch.Tensor, rules: DocumentRules | None) -> PackedDocs | None:
    if rules is None or not (rules.reset_attention_mask or rules.reset_position_ids):
        return None
    starts = document_starts(ids, rules.eod_id)
    return PackedDocs(Documents.from_starts(starts) if rules.reset_attention_mask else None,
                      document_positions(starts) if rules.reset_position_ids else None)


def mask_eod_targets(ids: torch.Tensor, labels: torch.Tensor, rules: DocumentRules | None,
                     ignore_index: int) -> torch.Tensor:
    """labels with the targets predicted at EOD inputs ignored (eod_mask_loss), else unchanged."""
    if rules is None or not rules.eod_mask_loss:
        return labels
    return labels.masked_fill(ids == rules.eod_id, ignore_index)
