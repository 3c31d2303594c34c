"""Megatron-LM's indexed datasets: a corpus as `PREFIX.bin` (token ids) + `PREFIX.idx` (the index),
written by Megatron's `tools/preprocess_data.py`, megatron-core's `IndexedDatasetBuilder` or
`fivefold preprocess`, named on the command line by its prefix (`--data-path PREFIX`), or a weighted
blend of several (`--data-path 0.3 PREFIX_A 0.7 PREFIX_B`).

The index is read by megatron-core's own reader (`megatron.core.datasets.indexed_dataset`, imported
when a prefix is used); the token stream is the .bin memory-mapped, so ranks read only what they use.
A prefix is told apart from a raw token file (`.bin` without an index, `fivefold.data.dataset`) by the
`.idx` beside it.

Splits (`--split 969,30,1`, Megatron's rule): the weights are normalised and the corpus is cut by
sequence (a document per sequence, as preprocess_data writes it) into contiguous train / validation /
test ranges, `[round(b0 * n), round(b1 * n))` for the cumulative bounds b; fivefold trains on the
first and evaluates on the second. The stream of a range is its sequences concatenated as stored (the
end-of-document token is in the data when the corpus was written with `--append-eod`).

Order (documented difference): Megatron's GPTDataset shuffles documents per epoch and builds a
sample index with its own seeded RNG; fivefold cuts each range's stream into consecutive samples of
S + 1 tokens and shuffles the samples per epoch with training.seed (fivefold.data.sampler). The token
stream is the same; the sample order is not Megatron's. Blends follow Megatron's BlendedDataset rule:
sample i comes from the source whose share so far lags its weight most (`blend_order`).
"""
from __future__ import annotations

import gc
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fivefold.config.data_split import split_problem, split_weights
from fivefold.errors import UserError

DEFAULT_SPLIT = "969,30,1"
"""Megatron-LM's --split default."""


def is_prefix(path: str) -> bool:
    """A Megatron indexed dataset: PREFIX.idx and PREFIX.bin both exist."""
    return Path(path + ".idx").is_file() and Path(path + ".bin").is_file()


def half_prefix(path: str) -> str | None:
    """What is wrong with `path` as a prefix when only one of PREFIX.bin / PREFIX.idx exists (a copy
    that left one behind), or None."""
    found = [s for s in (".bin", ".idx") if Path(path + s).is_file()]
    if len(found) != 1:
        return None
    missing = ".idx" if found == [".bin"] else ".bin"
    return (f"{path}{found[0]} was found but {path}{missing} is missing: a Megatron indexed dataset is both "
            "files (copy the other one, or write both with `fivefold preprocess`)")


def parse_blend(path: str) -> list[tuple[float, str]] | None:
    """`--data-path`'s forms: one prefix -> [(1.0, prefix)]; `w1 p1 w2 p2 ...` -> the pairs (weights
    normalised); None when `path` is neither (another kind of data)."""
    if is_prefix(path):
        return [(1.0, path)]
    words = path.split()
    if len(words) < 2 or Path(path).exists():
        return None
    if len(words) % 2:
        raise UserError(f"data.path={path!r}: a blend is `WEIGHT PREFIX WEIGHT PREFIX ...` (an even number of "
                        f"words, got {len(words)})")
    pairs = []
    for w, prefix in zip(words[::2], words[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise UserError(f"data.path={path!r}: {w!r} is not a weight (a blend is `0.3 PREFIX_A 0.7 PREFIX_B`)"
                            ) from None
        if not is_prefix(prefix):
            raise UserError(f"data.path blend: {half_prefix(prefix)}" if half_prefix(prefix) else
                            f"data.path blend: no indexed dataset at {prefix!r} (need {prefix}.bin and "
                            f"{prefix}.idx; write them with `fivefold preprocess`)")
        if weight < 0:
            raise UserError(f"data.path blend: weight {w} of {prefix} is negative")
        pairs.append((weight, prefix))
    total = sum(w for w, _ in pairs)
    if total <= 0:
        raise UserError(f"data.path={path!r}: the blend's weights add up to 0")
    return [(w / total, p) for w, p in pairs]


@dataclass(frozen=True)
class Corpus:
    """One indexed dataset: its token stream and where each sequence starts."""

    prefix: str
    tokens: np.ndarray
    """The .bin, memory-mapped, of the index's dtype."""
    starts: np.ndarray
    """Token offset of each sequence, plus the stream's end (len = sequences + 1)."""


def _megatron_reader(prefix: str):
    """megatron-core's IndexedDataset over `prefix` (UserError naming the file when it cannot read it)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed" (CPU)
            from megatron.core.datasets.indexed_dataset import IndexedDataset
    except ImportError:
        raise UserError(f"data.path={prefix!r} is a Megatron indexed dataset (.bin + .idx): reading it needs "
                        "megatron-core (pip install 'megatron-core>=0.16.1,<0.20'; it imports on CPU)") from None
    if os.path.getsize(prefix + ".bin") == 0:
        raise UserError(f"{prefix}.bin is empty: copy or write the corpus again")
    hook, sys.unraisablehook = sys.unraisablehook, lambda _: None  # a half-built reader's __del__ complains
    try:
        return IndexedDataset(prefix, mmap=True)
    except Exception as e:  # noqa: BLE001 (the reader asserts, or numpy fails on a short buffer)
        problem = f"{type(e).__name__}: {e}"
    finally:
        sys.unraisablehook = hook
    gc.collect()  # the half-built reader, quietly (its exception is gone)
    raise UserError(f"{prefix}.idx: not a readable Megatron index ({problem}); the file is truncated or corrupt: "
                    "write it again (fivefold preprocess, or Megatron's tools/preprocess_data.py)")


def open_corpus(prefix: str) -> Corpus:
    """The corpus at `prefix`, its index read by megatron-core and checked against the .bin."""
    ds = _megatron_reader(prefix)
    lengths = np.asarray(ds.sequence_lengths, dtype=np.int64)
    dtype = np.dtype(ds.index.dtype)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    pointers = np.asarray(ds.index.sequence_pointers, dtype=np.int64)
    if len(pointers) and not np.array_equal(pointers, starts[:-1] * dtype.itemsize):
        raise UserError(f"{prefix}.idx: its sequences are not stored one after another in {prefix}.bin "
                        "(not a GPT corpus as preprocess_data writes it)")
    size = os.path.getsize(prefix + ".bin")
    need = int(starts[-1]) * dtype.itemsize
    if size < need:
        raise UserError(f"{prefix}.bin: {size} bytes, its index needs {need} ({int(starts[-1])} {dtype.name} "
                        "tokens): the file is truncated; copy or write it again")
    tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r", shape=(int(starts[-1]),)) if need else \
        np.zeros(0, dtype=dtype)
    return Corpus(prefix, tokens, starts)


def split_ranges(split: str, n: int) -> list[tuple[int, int]]:
    """Megatron's `--split` over n sequences: [(begin, end)] for train, validation, test."""
    problem = split_problem(split)
    if problem:
        raise UserError(f"data.split={split!r}: {problem}")
    weights = split_weights(split)
    weights += [0.0] * (3 - len(weights))
    bounds = np.concatenate([[0.0], np.cumsum(np.array(weights) / sum(weights))])
    cut = [int(round(b * n)) for b in bounds]
    return [(cut[i], cut[i + 1]) for i in range(3)]


def blend_order(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(source, index within the source) of each of `size` blended samples: sample i comes from the
    source whose count so far lags weights[k] * max(i, 1) the most, the first such on a tie
    (Megatron's blending rule, its helpers' build_blending_indices), and the n-th sample drawn from a
    source is its n-th sample."""
    w = np.asarray(weights, dtype=np.float64)
    counts = np.zeros(len(w), dtype=np.int64)
    source = np.empty(size, dtype=np.int64)
    within = np.empty(size, dtype=np.int64)
    for i in range(size):
        k = int(np.argmax(w * max(i, 1) - counts))
        source[i], within[i] = k, counts[k]
        counts[k] += 1
    return source, within


MOCK_SEQUENCES, MOCK_MAX_LENGTH, MOCK_SEED = 100_000, 4096, 0
"""megatron-core's MockGPTLowLevelDataset: its corpus size, sequence length bound and seed."""


def mock_corpus(vocab_size: int, eod: int, split: str, tokens: tuple[int, int]) -> tuple[Corpus, list[tuple[int, int]]]:
    """Megatron's --mock-data corpus (megatron-core's MockGPTLowLevelDataset): sequence i has a seeded
    random length L_i in [1, 4096) and holds (1, 2, ..., L_i - 1) mod vocab then the end-of-document
    id. Only the sequences the run reads are made: of the train and validation ranges of `split`
    (over the 100000 sequences, Megatron's rule), the first ones holding `tokens` (train, eval)
    tokens. Returns the corpus of those sequences and their (begin, end) in it, train then eval."""
    lengths = np.random.default_rng(MOCK_SEED).integers(1, MOCK_MAX_LENGTH, size=MOCK_SEQUENCES, dtype=np.int32)
    picked, ranges = [], []
    for (begin, end), need in zip(split_ranges(split, MOCK_SEQUENCES)[:2], tokens):
        cum = np.cumsum(lengths[begin:end], dtype=np.int64)
        count = min(end - begin, int(np.searchsorted(cum, need)) + 1) if need > 0 else 0
        ranges.append((len(picked), len(picked) + count))
        picked += [int(n) for n in lengths[begin: begin + count]]
    parts = [np.concatenate([(np.arange(n - 1, dtype=np.int64) + 1) % vocab_size, [eod]]) for n in picked]
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(picked)]).astype(np.int64)
    return Corpus("mock", stream, starts), ranges
