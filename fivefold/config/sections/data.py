"""data: where the tokens come from and how they are cut (a section of fivefold.config.schema.Config)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class DataConfig:
    path: str | None = None
    """A text file, a folder of files, a .jsonl, a token file (.bin/.npy), a Megatron indexed dataset's
    prefix (PREFIX.bin + PREFIX.idx), or a blend `0.3 PREFIX_A 0.7 PREFIX_B` (a YAML list is joined);
    None = Python's stdlib sources."""
    format: str = "auto"
    """auto, text, jsonl, tokens or indexed. Default auto (from the path)."""
    mock_data: bool = False
    """Megatron's --mock-data: megatron-core's mock corpus (seeded random-length sequences of
    1, 2, ... mod vocab, each ending in the end-of-document id) instead of data.path. Default False."""
    split: str | None = None
    """Indexed datasets and mock data: Megatron's --split (train, validation, test proportions by sequence, e.g.
    969,30,1); None = 1 - eval_fraction, eval_fraction, 0. Default None."""
    tokenizer_type: str | None = None
    """Megatron's --tokenizer-type: HuggingFaceTokenizer (data.tokenizer = its local folder),
    GPT2BPETokenizer (vocab_file + merge_file; what a Megatron line with --vocab-file means when it names
    no type, as pretrain_gpt.py's default), NullTokenizer (ids below model.vocab_size, which then grows
    by one for the end-of-document id, as Megatron's); None = from data.tokenizer. Default None."""
    vocab_file: str | None = None
    """GPT-2's vocab.json for GPT2BPETokenizer (Megatron's --vocab-file). Default None."""
    merge_file: str | None = None
    """GPT-2's merges.txt for GPT2BPETokenizer (Megatron's --merge-file). Default None."""
    jsonl_field: str = "text"
    """The JSONL field holding the text. Default text."""
    token_dtype: str = "uint16"
    """uint16 or uint32 for pre-tokenized token files. Default uint16."""
    tokenizer: str = "byte"
    """byte (no download), or a local HF tokenizer directory. Default byte."""
    packing: bool = True
    """Pack documents into fixed-length sequences with an end-of-document token. Default True."""
    eval_fraction: float = 0.05
    """Held-out share of documents for evaluation. Default 0.05."""
    max_documents: int | None = None
    """Cap on documents read (for quick runs). Default None."""
    reset_position_ids: bool = False
    """Packed sequences: RoPE positions restart at 0 after every end-of-document token (Megatron
    --reset-position-ids). Default False."""
    reset_attention_mask: bool = False
    """Packed sequences: each document attends only to itself, in every layout (Megatron
    --reset-attention-mask; fivefold.data.documents). Default False."""
    eod_mask_loss: bool = False
    """No loss on the prediction made at an end-of-document token (Megatron --eod-mask-loss); the loss
    is then the mean over the remaining target tokens. Default False."""
