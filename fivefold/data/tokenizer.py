"""Tokenizers: a byte-level one that needs nothing, or a Hugging Face tokenizer from a local folder.

Both give `encode(text) -> np.ndarray` of ids, `vocab_size`, and `eod_id`: the end-of-document
token appended after each document when documents are packed into sequences.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from fivefold.errors import UserError


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255. Id 0 (the NUL byte, absent from text) marks the end of a document;
    NUL bytes inside a document are dropped so that it keeps that meaning."""

    vocab_size = 256
    eod_id = 0
    name = "byte"

    def encode(self, text: str) -> np.ndarray:
        ids = np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)
        return ids[ids != self.eod_id].astype(np.uint32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) != self.eod_id).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer saved by `transformers` in a local folder (tokenizer.json / tokenizer_config.json);
    never downloads. End of document = the tokenizer's EOS token."""

    def __init__(self, folder: str):
        path = Path(folder)
        if not path.is_dir():
            raise UserError(f"data.tokenizer={folder!r}: not a folder; give 'byte' or a local Hugging Face "
                            "tokenizer folder (with tokenizer.json or tokenizer_config.json)")
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise UserError(f"data.tokenizer={folder!r}: cannot load a tokenizer from it ({e})") from None
        if self._tok.eos_token_id is None:
            raise UserError(f"data.tokenizer={folder!r}: the tokenizer has no EOS token to mark document ends")
        self.vocab_size = len(self._tok)
        self.eod_id = int(self._tok.eos_token_id)
        self.name = str(path.resolve())

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False), dtype=np.uint32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def make_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """'byte' -> ByteTokenizer; anything else is a local Hugging Face tokenizer folder."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)
