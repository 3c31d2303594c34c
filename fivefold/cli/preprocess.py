"""`fivefold preprocess --input DATA --output-prefix P [--tokenizer-type HuggingFaceTokenizer
--tokenizer-model DIR | --vocab-file V --merge-file M] [--json-keys text] [--append-eod]`: a Megatron
indexed dataset from text.

The flags are those of Megatron-LM's `tools/preprocess_data.py`, and so is the result: for each JSON
key, `P_{key}_document.bin` + `.idx`, one document per JSONL record (or per file of a folder, or the
whole text file), written by megatron-core's own `IndexedDatasetBuilder`, ready for
`--data-path P_text_document` here or in Megatron. The default tokenizer is fivefold's byte tokenizer
(no download); `--append-eod` ends each document with the tokenizer's end-of-document id.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

import numpy as np

from fivefold.errors import UserError

HELP = "write a Megatron indexed dataset (PREFIX.bin + .idx) from text / JSONL, as tools/preprocess_data.py does"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, help="a .jsonl, a text file or a folder of them")
    p.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX_{key}_document.bin/.idx")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSONL fields to write, one dataset each")
    p.add_argument("--tokenizer-type", default=None,
                   help="HuggingFaceTokenizer or GPT2BPETokenizer (default: fivefold's byte tokenizer; GPT2BPETokenizer "
                        "when --vocab-file is given)")
    p.add_argument("--tokenizer-model", default=None, help="the Hugging Face tokenizer's local folder")
    p.add_argument("--vocab-file", default=None, help="GPT-2's vocab.json (GPT2BPETokenizer)")
    p.add_argument("--merge-file", default=None, help="GPT-2's merges.txt (GPT2BPETokenizer)")
    p.add_argument("--append-eod", action="store_true", help="end every document with the end-of-document id")
    p.add_argument("--workers", type=int, default=1, help="accepted for Megatron's command lines; one process")
    p.add_argument("--log-interval", type=int, default=None, help="accepted for Megatron's command lines")


PARTIAL = ".partial"
"""What the files being written are named with, until they are complete (then renamed over the
prefix's: a run stopped by bad input or Ctrl-C leaves an earlier dataset of that prefix as it was)."""


def _builder_class():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    except ImportError:
        raise UserError("fivefold preprocess writes with megatron-core's IndexedDatasetBuilder: "
                        "pip install 'megatron-core>=0.16.1,<0.20' (it imports on CPU)") from None
    return IndexedDatasetBuilder


def run(args, extra: list[str]) -> int:
    from tqdm import tqdm

    from fivefold.data.sources import read_documents, resolve_format
    from fivefold.data.tokenizer import make_tokenizer

    tokenizer = args.tokenizer_type or ("GPT2BPETokenizer" if args.vocab_file else None)
    if tokenizer not in (None, "HuggingFaceTokenizer", "GPT2BPETokenizer"):
        raise UserError(f"--tokenizer-type {args.tokenizer_type}: not implemented yet (HuggingFaceTokenizer with "
                        "--tokenizer-model DIR, GPT2BPETokenizer with --vocab-file / --merge-file, or leave it out for "
                        "the byte tokenizer)")
    if tokenizer == "HuggingFaceTokenizer" and not args.tokenizer_model:
        raise UserError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR (a folder with tokenizer.json)")
    if not Path(args.input).exists():
        raise UserError(f"--input {args.input}: no such file or folder (give a .jsonl, a text file or a folder "
                        "of them)")
    kind = resolve_format(args.input, "auto")
    if kind in ("tokens", "indexed", "stdlib"):
        raise UserError(f"--input {args.input}: give text, a .jsonl or a folder of them (it is {kind} data)")
    if tokenizer == "GPT2BPETokenizer" and not (args.vocab_file and args.merge_file):
        raise UserError("--tokenizer-type GPT2BPETokenizer needs GPT-2's --vocab-file vocab.json and --merge-file "
                        "merges.txt")
    tok = make_tokenizer(args.tokenizer_model or "byte", tokenizer, vocab_file=args.vocab_file,
                         merge_file=args.merge_file)
    dtype = np.uint16 if tok.vocab_size < 65500 else np.int32  # as Megatron's DType.optimal_dtype
    builder_cls = _builder_class()
    for key in args.json_keys:
        prefix = f"{args.output_prefix}_{key}_document"
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)
        partial = prefix + PARTIAL  # an earlier dataset under this prefix stays whole until this one is
        builder = builder_cls(partial + ".bin", dtype=dtype)
        docs = tokens = 0
        try:
            texts = read_documents(args.input, "auto", key, keys=("--input", "--json-keys"))
            for text in tqdm(texts, desc=f"preprocess {key}", unit=" docs", disable=not sys.stderr.isatty()):
                ids = tok.encode(text).astype(np.int64)
                if args.append_eod:
                    ids = np.append(ids, tok.eod_id)
                if len(ids) == 0:
                    continue
                builder.add_document(ids, [len(ids)])
                docs, tokens = docs + 1, tokens + len(ids)
            if docs == 0:
                raise UserError(f"--input {args.input}: no text found under key {key!r}")
            builder.finalize(partial + ".idx")
        except BaseException:
            for suffix in (".bin", ".idx"):
                Path(partial + suffix).unlink(missing_ok=True)
            raise
        for suffix in (".bin", ".idx"):
            os.replace(partial + suffix, prefix + suffix)
        print(f"{prefix}.bin/.idx: {docs} documents, {tokens} tokens ({np.dtype(dtype).name}); "
              f"train with --data-path {prefix}")
    return 0
