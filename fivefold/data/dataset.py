"""Token streams on disk and the datasets that cut them into training samples.

`prepare_data` tokenizes the documents once (in the launcher, before ranks start), splits them into a
train and a held-out eval part, and writes each part as one memory-mapped token stream plus the
offsets where its documents start. Pre-tokenized token files (uint16/uint32, as nanoGPT writes them)
are mapped directly and split by position; Megatron's indexed datasets (PREFIX.bin + .idx, and
weighted blends of them) are mapped directly and split by sequence (fivefold.data.indexed). Ranks only
map these files.

Samples:
  packed (default): sample i = stream[i*S : i*S + S + 1], S = seq_length; documents are concatenated,
    each followed by the end-of-document token (Megatron / nanoGPT layout; the +1 is the last target).
  unpacked: sample i = document i with its end-of-document token, cut to at most S + 1 tokens.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from fivefold.config.schema import DataConfig
from fivefold.data.indexed import blend_order, mock_corpus, open_corpus, parse_blend, split_ranges
from fivefold.data.sources import read_documents, resolve_format, source_files
from fivefold.data.tokenizer import Tokenizer
from fivefold.errors import UserError, write_failed

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


@dataclass(frozen=True)
class Split:
    """One part (train or eval) of the corpus: a token stream and its document start offsets."""

    tokens: np.ndarray
    doc_starts: np.ndarray | None
    """Offsets of document starts plus the stream end (len = documents + 1); None for token files."""


@dataclass(frozen=True)
class Blend:
    """Weighted parts (Megatron's `--data-path 0.3 A 0.7 B`), one Split per indexed dataset."""

    weights: list[float]
    parts: list[Split]


def load_token_file(path: str, dtype: str) -> np.ndarray:
    """A pre-tokenized stream: raw .bin of `dtype` (memory-mapped), or a 1-D .npy."""
    if dtype not in TOKEN_DTYPES:
        raise UserError(f"data.token_dtype={dtype!r}: must be uint16 or uint32")
    if path.endswith(".npy"):
        arr = np.load(path, mmap_mode="r")
        if arr.ndim != 1 or arr.dtype.kind not in "ui":
            raise UserError(f"{path}: a token .npy must be a 1-D integer array, got {arr.dtype} {arr.shape}")
        return arr
    size = os.path.getsize(path)
    item = np.dtype(TOKEN_DTYPES[dtype]).itemsize
    if size % item:
        raise UserError(f"{path}: {size} bytes is not a whole number of {dtype} tokens; check data.token_dtype")
    return np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r")


def _fingerprint(data: DataConfig, tokenizer_name: str, seed: int) -> str:
    blob = json.dumps({"data": asdict(data), "tokenizer": tokenizer_name, "seed": seed}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _stamp(files: Iterable[Path]) -> list[list]:
    """What the cache was built from: each source or tokenizer file's resolved path, size and mtime_ns.
    Not a hash of the contents: the sources may be many GB (token files, indexed corpora) and the check
    runs at every launch; a stat is what make and rsync trust, and rewriting a file moves its mtime."""
    out = []
    for f in files:
        st = f.stat()
        out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return out


def prepare_data(data: DataConfig, tokenizer: Tokenizer, cache_dir: str | Path,
                 seed: int, *, mock_tokens: tuple[int, int] = (0, 0), vocab_size: int | None = None) -> Path:
    """Tokenize and split the corpus into `cache_dir`, reused only when the data config, its source
    files and the tokenizer's files (vocab / merges, tokenizer.json: `_stamp`) are unchanged; otherwise
    built again, with every check of a first build.

    The eval part: each document is held out with probability `eval_fraction` (seeded), at least one
    document on each side when there are two or more; a single document is split by position.
    """
    cache = Path(cache_dir)
    kind = "mock" if data.mock_data else resolve_format(data.path, data.format)
    fp = _fingerprint(data, f"{tokenizer.name}/{mock_tokens}/{vocab_size}", seed)
    stamp = _stamp(source_files(data.path, kind)) if kind != "mock" else []
    tokenizer_stamp = _stamp(tokenizer.files)
    meta_path = cache / "meta.json"
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        # (a cache written before tokenizer files were recorded: the byte tokenizer's, which has none, stays valid)
        if old.get("fingerprint") == fp and old.get("source_files") == stamp and \
                old.get("tokenizer_files", []) == tokenizer_stamp:
            return cache
    meta = {"fingerprint": fp, "source_files": stamp, "tokenizer_files": tokenizer_stamp, "kind": kind,
            "vocab_size": tokenizer.vocab_size, "eod_id": tokenizer.eod_id}
    tmp = cache.with_name(cache.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        _build(data, tokenizer, tmp, meta, seed, mock_tokens, vocab_size)
        shutil.rmtree(cache, ignore_errors=True)
        os.replace(tmp, cache)
    except OSError as e:  # a full disk, a read-only folder: named, the half-written folder removed
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failed(e.filename or tmp, e, "the tokenized training data") from None
    except BaseException:  # (Ctrl-C too) a failed build leaves no half-written OUT/data.tmp behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return cache


def _build(data: DataConfig, tokenizer, tmp: Path, meta: dict, seed: int, mock_tokens: tuple[int, int],
           vocab_size: int | None) -> None:
    """Write the cache's files and its meta.json into `tmp`."""
    kind = meta["kind"]
    if kind == "tokens":
        stream = load_token_file(str(Path(data.path).resolve()), data.token_dtype)
        meta.update(source=str(Path(data.path).resolve()), dtype=data.token_dtype, num_tokens=int(len(stream)),
                    max_id=int(stream.max()) if len(stream) else 0, min_id=int(stream.min()) if len(stream) else 0)
    elif kind == "mock":  # `mock_tokens` (train, eval) tokens of the model's vocabulary, made by every rank
        meta.update(vocab_size=vocab_size, split=_split_of(data), tokens=list(mock_tokens), max_id=vocab_size - 1)
    elif kind == "indexed":
        meta.update(sources=[_indexed_source(weight, prefix, data) for weight, prefix in parse_blend(data.path)])
        meta.update(max_id=max(src["max_id"] for src in meta["sources"]),
                    min_id=min(src["min_id"] for src in meta["sources"]))
    else:
        docs = [tokenizer.encode(text) for text in read_documents(data.path, data.format, data.jsonl_field,
                                                                  data.max_documents)]
        docs = [d for d in docs if len(d)]
        if not docs:
            raise UserError(f"data.path={data.path!r}: no text found")
        dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
        for name, part in zip(("train", "eval"), _split_documents(docs, data.eval_fraction, seed)):
            _write_split(tmp, name, part, tokenizer.eod_id, dtype)
        meta.update(dtype=np.dtype(dtype).name)
    _write_meta(tmp, meta)


def _write_meta(folder: Path, meta: dict) -> None:
    """The cache's meta.json, written last: a cache folder without it is never reused."""
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))


def _indexed_source(weight: float, prefix: str, data: DataConfig) -> dict:
    """One indexed dataset of a (possibly one-part) blend: its train and eval sequence ranges."""
    corpus = open_corpus(prefix)
    train, valid, _ = split_ranges(_split_of(data), len(corpus.starts) - 1)
    return {"weight": weight, "prefix": str(Path(prefix).resolve()), "train": train, "eval": valid,
            "max_id": int(max((chunk.max() for chunk in _chunks(corpus.tokens)), default=0)),
            "min_id": int(min((chunk.min() for chunk in _chunks(corpus.tokens)), default=0))}


def _split_of(data: DataConfig) -> str:
    return data.split if data.split is not None else f"{1 - data.eval_fraction},{data.eval_fraction},0"


def _chunks(tokens: np.ndarray, size: int = 1 << 24):
    for i in range(0, len(tokens), size):
        yield np.asarray(tokens[i: i + size])


def _split_documents(docs: list[np.ndarray], fraction: float, seed: int) -> tuple[list, list]:
    if fraction <= 0:
        return docs, []
    if len(docs) == 1:
        cut = int(len(docs[0]) * (1 - fraction))
        return [docs[0][:cut]], [docs[0][cut:]]
    held = np.random.default_rng(seed).random(len(docs)) < fraction
    if held.all() or not held.any():
        held[:] = False
        held[-1] = True
    return [d for d, h in zip(docs, held) if not h], [d for d, h in zip(docs, held) if h]


def _write_split(folder: Path, name: str, docs: list[np.ndarray], eod: int, dtype) -> None:
    lengths = np.array([len(d) + 1 for d in docs], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    stream = np.full(int(starts[-1]), eod, dtype=dtype)
    for d, s in zip(docs, starts[:-1]):
        stream[s:s + len(d)] = d
    stream.tofile(folder / f"{name}.bin")
    np.save(folder / f"{name}_docs.npy", starts)


def load_splits(cache_dir: str | Path, eval_fraction: float) -> tuple[Split | Blend, Split | Blend]:
    """(train, eval) memory-mapped from a folder written by `prepare_data`."""
    cache = Path(cache_dir)
    meta = json.loads((cache / "meta.json").read_text())
    if meta["kind"] == "mock":
        corpus, ranges = mock_corpus(meta["vocab_size"], meta["eod_id"], meta["split"], tuple(meta["tokens"]))
        return _range_split(corpus, *ranges[0]), _range_split(corpus, *ranges[1])
    if meta["kind"] == "indexed":
        corpora = [open_corpus(src["prefix"]) for src in meta["sources"]]
        out = []
        for part in ("train", "eval"):
            splits = [_range_split(c, *src[part]) for c, src in zip(corpora, meta["sources"])]
            out.append(splits[0] if len(splits) == 1 else Blend([src["weight"] for src in meta["sources"]], splits))
        return out[0], out[1]
    if meta["kind"] == "tokens":
        stream = load_token_file(meta["source"], meta["dtype"])
        cut = int(len(stream) * (1 - eval_fraction))
        return Split(stream[:cut], None), Split(stream[cut:], None)
    parts = []
    for name in ("train", "eval"):
        tokens = np.memmap(cache / f"{name}.bin", dtype=meta["dtype"], mode="r") \
            if (cache / f"{name}.bin").stat().st_size else np.zeros(0, dtype=meta["dtype"])
        parts.append(Split(tokens, np.load(cache / f"{name}_docs.npy")))
    return parts[0], parts[1]


def _range_split(corpus, begin: int, end: int) -> Split:
    """Sequences [begin, end) of an indexed corpus as one stream (a document per sequence)."""
    lo, hi = int(corpus.starts[begin]), int(corpus.starts[end])
    return Split(corpus.tokens[lo:hi], corpus.starts[begin: end + 1] - lo)


def data_meta(cache_dir: str | Path) -> dict:
    return json.loads((Path(cache_dir) / "meta.json").read_text())


class PackedDataset:
    """Fixed-length samples of S + 1 tokens cut from one stream (consecutive samples share one token)."""

    def __init__(self, split: Split, seq_length: int):
        self.tokens, self.seq_length = split.tokens, seq_length
        self.num_samples = max(0, (len(split.tokens) - 1) // seq_length)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        s = self.seq_length
        return np.asarray(self.tokens[i * s: i * s + s + 1], dtype=np.int64)


class DocumentDataset:
    """One document per sample (with its end-of-document token), cut to at most S + 1 tokens."""

    def __init__(self, split: Split, seq_length: int):
        if split.doc_starts is None:
            raise UserError("data.packing=false needs document boundaries; a token file is one stream "
                            "(use data.packing=true, or give text / JSONL data)")
        starts = split.doc_starts
        keep = np.nonzero(np.diff(starts) >= 2)[0]  # a sample needs an input and a target
        self.tokens, self.seq_length = split.tokens, seq_length
        self.starts = starts[keep]
        self.lengths = np.minimum(np.diff(starts)[keep], seq_length + 1)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> np.ndarray:
        s = int(self.starts[i])
        return np.asarray(self.tokens[s: s + int(self.lengths[i])], dtype=np.int64)

    def target_tokens(self, i: int) -> int:
        return int(self.lengths[i]) - 1


class BlendedDataset(PackedDataset):
    """Packed samples drawn from several sources by weight (Megatron's BlendedDataset rule,
    fivefold.data.indexed.blend_order), as many as the sources hold without repeating a sample."""

    def __init__(self, blend: Blend, seq_length: int):
        self.parts = [PackedDataset(s, seq_length) for s in blend.parts]
        self.seq_length = seq_length
        size = min(int(len(p) / w) for w, p in zip(blend.weights, self.parts) if w > 0)
        self.source, self.within = blend_order(blend.weights, size)
        short = np.nonzero(self.within >= np.array([len(p) for p in self.parts])[self.source])[0]
        self.num_samples = int(short[0]) if len(short) else size

    def __getitem__(self, i: int) -> np.ndarray:
        return self.parts[int(self.source[i])][int(self.within[i])]


def dataset_of(split: Split | Blend, seq_length: int, packing: bool) -> PackedDataset | DocumentDataset:
    """The training or eval dataset of a split (a blend is packed)."""
    if isinstance(split, Blend):
        if not packing:
            raise UserError("data.packing=false with a blend of datasets: not implemented yet (pack them, or "
                            "give one dataset)")
        return BlendedDataset(split, seq_length)
    return (PackedDataset if packing else DocumentDataset)(split, seq_length)
