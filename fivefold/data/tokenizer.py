"""Tokenizers: a byte-level one that needs nothing, a Hugging Face tokenizer from a local folder, and
Megatron-LM's GPT2BPETokenizer (--vocab-file + --merge-file) and NullTokenizer (--vocab-size).

Each gives `encode(text) -> np.ndarray` of ids, `vocab_size`, `eod_id` (the end-of-document token
appended after each document when documents are packed into sequences) and `files`: the files it was
read from, which the data cache records beside the corpus's (fivefold.data.dataset.prepare_data).
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
    files = ()

    def encode(self, text: str) -> np.ndarray:
        ids = np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)
        return ids[ids != self.eod_id].astype(np.uint32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) != self.eod_id).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer saved by `transformers` in a local folder (tokenizer.json / tokenizer_config.json);
    never downloads. End of document = the tokenizer's EOS token."""

    CONFIG_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
    """The files of the folder any tokenizer class reads, besides its own `vocab_files_names`
    (vocab.json and merges.txt, tokenizer.model, ...)."""

    def __init__(self, folder: str):
        path = Path(folder)
        if not path.is_dir():
            raise UserError(f"data.tokenizer={folder!r}: not a folder; give 'byte' or a local Hugging Face "
                            "tokenizer folder (with tokenizer.json or tokenizer_config.json)")
        if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            raise UserError(f"data.tokenizer={folder!r}: no tokenizer.json or tokenizer_config.json in it; give the "
                            "folder a Hugging Face tokenizer was saved to (save_pretrained), or 'byte'")
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
        names = {*self.CONFIG_FILES, *self._tok.vocab_files_names.values()}
        self.files = tuple(sorted(p for p in (path / n for n in names) if p.is_file()))

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False), dtype=np.uint32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


class GPT2BPETokenizer:
    """Megatron-LM's GPT2BPETokenizer: GPT-2's byte-level BPE from a vocab.json and a merges.txt
    (--vocab-file, --merge-file), read with the `tokenizers` library; end of document = <|endoftext|>."""

    EOD = "<|endoftext|>"

    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import ByteLevelBPETokenizer

        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path or not Path(path).is_file():
                raise UserError(f"GPT2BPETokenizer needs {flag} FILE (GPT-2's vocab.json / merges.txt); "
                                f"{path!r} is not a file")
        try:
            self._tok = ByteLevelBPETokenizer(vocab_file, merge_file)
        except Exception as e:  # the library's own errors for a broken JSON / merges file
            raise UserError(f"--vocab-file {vocab_file} / --merge-file {merge_file}: not a GPT-2 BPE vocabulary ({e})") \
                from None
        eod = self._tok.token_to_id(self.EOD)
        if eod is None:
            raise UserError(f"--vocab-file {vocab_file}: has no {self.EOD} token to mark document ends")
        self.vocab_size, self.eod_id = self._tok.get_vocab_size(), int(eod)
        self.name = f"gpt2bpe:{Path(vocab_file).resolve()}:{Path(merge_file).resolve()}"
        self.files = (Path(vocab_file), Path(merge_file))

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.uint32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


class NullTokenizer:
    """Megatron-LM's NullTokenizer: ids 0..V-1 for --vocab-size V and one more, V, as end of document
    (so the model's vocabulary is V + 1); for token data and --mock-data, it reads no text."""

    def __init__(self, vocab_size: int):
        self.vocab_size, self.eod_id, self.name = vocab_size + 1, vocab_size, f"null:{vocab_size}"
        self.files = ()

    def encode(self, text: str) -> np.ndarray:
        raise UserError("--tokenizer-type NullTokenizer reads no text: give pre-tokenized data (--data-path PREFIX "
                        "of an indexed dataset) or --mock-data, or a tokenizer (HuggingFaceTokenizer / GPT2BPETokenizer)")

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


Tokenizer = ByteTokenizer | HFTokenizer | GPT2BPETokenizer | NullTokenizer


def make_tokenizer(spec: str, kind: str | None = None, *, vocab_file: str | None = None,
                   merge_file: str | None = None, vocab_size: int | None = None) -> Tokenizer:
    """`kind` (a Megatron --tokenizer-type) if given; else 'byte' -> ByteTokenizer and anything else a
    local Hugging Face tokenizer folder."""
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if kind == "NullTokenizer":
        return NullTokenizer(vocab_size)
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)


def fitted_tokenizer(config) -> tuple[Tokenizer, str | None]:
    """The run's tokenizer, and the model's vocabulary sized by it as Megatron sizes it when the data
    section names a Megatron tokenizer (--tokenizer-type, or --vocab-file: GPT-2 BPE's 50,257 ids;
    NullTokenizer: --vocab-size ids + the end of document), unless the model comes from an HF checkpoint.
    Returns the note to print when model.vocab_size changed (None otherwise); the padding to a multiple of
    make_vocab_size_divisible_by x TP is the model's (ModelConfig.padded_vocab_size)."""
    d = config.data
    tok = tokenizer_of(d, config.model.vocab_size)
    if not (d.tokenizer_type or d.vocab_file) or config.checkpoint.load_hf or config.model.vocab_size == tok.vocab_size:
        return tok, None
    config.model.vocab_size = tok.vocab_size
    return tok, (f"model.vocab_size set to {tok.vocab_size} from {d.tokenizer_type or 'GPT2BPETokenizer'} (as Megatron "
                 "sizes the model by its tokenizer; NullTokenizer: --vocab-size ids + end of document)")


def tokenizer_of(data, vocab_size: int) -> Tokenizer:
    """The tokenizer a run's data section names (`vocab_size`: the model's, NullTokenizer's V); a
    vocab_file without a type is GPT2BPETokenizer, as in Megatron's pretrain_gpt.py."""
    kind = data.tokenizer_type or ("GPT2BPETokenizer" if data.vocab_file else None)
    return make_tokenizer(data.tokenizer, kind, vocab_file=data.vocab_file,
                          merge_file=data.merge_file, vocab_size=vocab_size)
