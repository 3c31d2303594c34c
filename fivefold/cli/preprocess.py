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
import contextlib
import os
import sys
import warnings
from pathlib import Path

import numpy as np

from fivefold.cli._outputs import output_folder
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


HF, BPE = "HuggingFaceTokenizer", "GPT2BPETokenizer"


def _tokenizer_kind(args) -> str | None:
    """The tokenizer the flags name (None: the byte tokenizer); a flag of another tokenizer is refused,
    not dropped."""
    bpe_flags = [f"{flag} {value}" for flag, value in (("--vocab-file", args.vocab_file),
                                                       ("--merge-file", args.merge_file)) if value]
    kind = args.tokenizer_type or (BPE if bpe_flags else None)
    if kind not in (None, HF, BPE):
        raise UserError(f"--tokenizer-type {args.tokenizer_type}: not implemented yet (HuggingFaceTokenizer with "
                        "--tokenizer-model DIR, GPT2BPETokenizer with --vocab-file / --merge-file, or leave it out for "
                        "the byte tokenizer)")
    if kind == BPE:
        if args.tokenizer_model:
            raise UserError(f"--tokenizer-model {args.tokenizer_model}: that is HuggingFaceTokenizer's flag; "
                            "GPT2BPETokenizer reads --vocab-file vocab.json and --merge-file merges.txt (give those, "
                            "or --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR)")
        if not (args.vocab_file and args.merge_file):
            given = f" ({bpe_flags[0]} was given alone)" if bpe_flags else ""
            raise UserError("GPT2BPETokenizer needs GPT-2's --vocab-file vocab.json and --merge-file merges.txt "
                            f"together{given}")
    elif bpe_flags:
        raise UserError(f"{' '.join(bpe_flags)}: GPT-2's BPE files go with GPT2BPETokenizer (give --vocab-file and "
                        f"--merge-file together, without --tokenizer-type or with --tokenizer-type GPT2BPETokenizer); "
                        f"{kind} reads --tokenizer-model DIR only")
    if kind == HF and not args.tokenizer_model:
        raise UserError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR (a folder with tokenizer.json)")
    return kind


def _output_prefixes(output_prefix: str, json_keys: list[str]) -> dict[str, str]:
    """PREFIX_{key}_document of each key, checked before any work: every file this run writes or
    renames can be written (no folder in the way), so that a run refused here leaves nothing."""
    if not output_prefix or output_prefix.endswith(("/", os.sep)):
        named = f"{output_prefix}corpus"
        raise UserError(f"--output-prefix {output_prefix!r}: the files would be named "
                        f"{output_prefix}_{json_keys[0]}_document.bin; give a name, e.g. --output-prefix "
                        f"{named} (writes {named}_{json_keys[0]}_document.bin/.idx)")
    twice = sorted({key for key in json_keys if json_keys.count(key) > 1})
    if twice:
        raise UserError(f"--json-keys {' '.join(json_keys)}: {', '.join(map(repr, twice))} given more than once "
                        "(each key writes one dataset); give each key once")
    for key in json_keys:
        # the key is part of a file name: a separator in it would write into (or fail to find) a
        # subfolder instead of beside the prefix's other files
        seps = sorted({sep for sep in ("/", os.sep, os.altsep) if sep and sep in key})
        if seps:
            safe = "".join("_" if ch in seps else ch for ch in key)
            raise UserError(f"--json-keys {key}: a key is part of the file names ({output_prefix}_{key}_document.bin), "
                            f"so it cannot hold {' or '.join(map(repr, seps))}; rename the field in the JSON "
                            f"records (e.g. to {safe!r}) and give --json-keys {safe}")
    folder = Path(output_prefix).parent
    above = next(p for p in (folder, *folder.parents) if p.exists() or p.is_symlink())
    if not above.is_dir():
        raise UserError(f"--output-prefix {output_prefix}: {above} is not a folder, so nothing can be "
                        "written under it; give a prefix in a folder (or remove the file)")
    prefixes = {key: f"{output_prefix}_{key}_document" for key in json_keys}
    for prefix in prefixes.values():
        for path in (prefix + suffix for name in (prefix, prefix + PARTIAL) for suffix in (".bin", ".idx")):
            if Path(path).exists() and not Path(path).is_file():
                what = "a folder" if Path(path).is_dir() else "not a regular file"
                raise UserError(f"--output-prefix {output_prefix}: {path} is {what}, and preprocess writes a "
                                "file there; remove it or give another --output-prefix")
    return prefixes


def _make_folder(folder: Path) -> list[Path]:
    """Make `folder` and the folders above it that are missing (`output_folder`); returns those made,
    deepest first."""
    made = []
    for p in (folder, *folder.parents):
        if p.exists():
            break
        made.append(p)
    output_folder("--output-prefix", folder)
    return made


@contextlib.contextmanager
def _writing(output_prefix: str, files: str):
    """An OSError writing `files` (disk full, a quota, no permission) ends the run with the file and
    the reason, not a traceback; `run` then removes the partial files."""
    try:
        yield
    except OSError as e:
        raise UserError(f"--output-prefix {output_prefix}: cannot write {e.filename or files} ({e.strerror or e}); "
                        "the partial files were removed: free space there or give another --output-prefix") from None


def run(args, extra: list[str]) -> int:
    from tqdm import tqdm

    from fivefold.data.sources import read_documents, resolve_format
    from fivefold.data.tokenizer import make_tokenizer

    tokenizer = _tokenizer_kind(args)
    if not Path(args.input).exists():
        raise UserError(f"--input {args.input}: no such file or folder (give a .jsonl, a text file or a folder "
                        "of them)")
    kind = resolve_format(args.input, "auto")
    if kind in ("tokens", "indexed", "stdlib"):
        raise UserError(f"--input {args.input}: give text, a .jsonl or a folder of them (it is {kind} data)")
    prefixes = _output_prefixes(args.output_prefix, args.json_keys)
    tok = make_tokenizer(args.tokenizer_model or "byte", tokenizer, vocab_file=args.vocab_file,
                         merge_file=args.merge_file)
    dtype = np.uint16 if tok.vocab_size < 65500 else np.int32  # as Megatron's DType.optimal_dtype
    builder_cls = _builder_class()
    made = _make_folder(Path(args.output_prefix).parent)
    counts = {}
    # every key's files are written as partials and renamed only once all are complete: a run stopped
    # by bad input (a record without the second key) or Ctrl-C leaves no dataset of any key, and the
    # earlier datasets under this prefix stay whole
    try:
        for key, prefix in prefixes.items():
            partial = prefix + PARTIAL
            with _writing(args.output_prefix, partial + ".bin"):
                builder = builder_cls(partial + ".bin", dtype=dtype)
            docs = tokens = 0
            texts = read_documents(args.input, "auto", key, keys=("--input", "--json-keys"), strict=True)
            for text in tqdm(texts, desc=f"preprocess {key}", unit=" docs", disable=not sys.stderr.isatty()):
                ids = tok.encode(text).astype(np.int64)
                if args.append_eod:
                    ids = np.append(ids, tok.eod_id)
                if len(ids) == 0:
                    continue
                with _writing(args.output_prefix, partial + ".bin"):
                    builder.add_document(ids, [len(ids)])
                docs, tokens = docs + 1, tokens + len(ids)
            if docs == 0:
                raise UserError(f"--input {args.input}: no text found under key {key!r}")
            with _writing(args.output_prefix, f"{partial}.bin / .idx"):  # (the .bin's last bytes land at its close)
                builder.finalize(partial + ".idx")
            counts[key] = docs, tokens
    except BaseException:
        for prefix in prefixes.values():
            for suffix in (".bin", ".idx"):
                Path(prefix + PARTIAL + suffix).unlink(missing_ok=True)
        for folder in made:  # deepest first; one that holds something else now stays
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    for key, prefix in prefixes.items():
        for suffix in (".bin", ".idx"):
            os.replace(prefix + PARTIAL + suffix, prefix + suffix)
        docs, tokens = counts[key]
        print(f"{prefix}.bin/.idx: {docs} documents, {tokens} tokens ({np.dtype(dtype).name}); "
              f"train with --data-path {prefix}")
    return 0
