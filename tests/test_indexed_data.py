"""Megatron indexed datasets (`--data-path PREFIX`, blends, `--split`) read against megatron-core's own
reader and helpers, `fivefold preprocess`, and the refusals of broken corpora."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from _train_util import one_process_context
from fivefold.cli import main
from fivefold.cli.train import prepare
from fivefold.config.load import load_config
from fivefold.data.dataset import Blend, BlendedDataset, dataset_of, load_splits
from fivefold.data.indexed import blend_order, open_corpus, split_ranges
from fivefold.errors import UserError
from fivefold.train.loop import train

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core on CPU: "Transformer Engine and Apex are not installed"
    from megatron.core.datasets import helpers_cpp
    from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                        parse_and_normalize_split)
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def _write(prefix, docs: list[np.ndarray], dtype=np.uint16) -> str:
    """A corpus as megatron-core's builder writes it (one sequence per document)."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for d in docs:
        builder.add_document(d, [len(d)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def _docs(seed: int, n: int, vocab: int = 200) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(1, vocab, int(rng.integers(5, 90))), 0) for _ in range(n)]


@pytest.mark.parametrize("split", ["969, 30, 1", "7,2,1", "90,10", "1,1,1", "100"])
@pytest.mark.parametrize("n", [1, 3, 10, 157])
def test_split_ranges_follow_megatron(split, n):
    bounds = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    want = [(int(round(b[0] * n)), int(round(b[1] * n))) if b is not None else None for b in bounds]
    got = split_ranges(split, n)
    assert [g if w is not None else None for g, w in zip(got, want)] == want
    assert all(g[0] == g[1] for g, w in zip(got, want) if w is None)  # an empty part is empty here too


def test_blend_order_is_megatrons():
    rng = np.random.default_rng(0)
    for _ in range(10):
        k = int(rng.integers(1, 5))
        w = rng.random(k)
        w /= w.sum()
        size = int(rng.integers(1, 400))
        source, within = np.zeros(size, dtype=np.int16), np.zeros(size, dtype=np.int64)
        helpers_cpp.build_blending_indices(source, within, w, k, size, False)
        got = blend_order(list(w), size)
        assert np.array_equal(got[0], source) and np.array_equal(got[1], within)


def test_token_streams_equal_megatrons_reader(tmp_path):
    """The train and eval streams of `--data-path PREFIX --split 7,2,1` are the sequences Megatron's
    IndexedDataset yields for those ranges, concatenated; a blend keeps each source's."""
    a = _write(tmp_path / "a", _docs(0, 40))
    b = _write(tmp_path / "b", _docs(1, 25), dtype=np.int32)
    loaded = load_config(None, ["--data-path", "0.25", a, "0.75", b, "--split", "7,2,1", "--seq-length", "32"])
    cfg = loaded.config
    assert cfg.data.split == "7,2,1" and cfg.data.path == f"0.25 {a} 0.75 {b}"
    data_dir = prepare(cfg, tmp_path / "out")
    train_part, eval_part = load_splits(data_dir, cfg.data.eval_fraction)
    assert isinstance(train_part, Blend) and train_part.weights == [0.25, 0.75]
    for prefix, got_train, got_eval in zip((a, b), train_part.parts, eval_part.parts):
        reader = IndexedDataset(prefix)
        (t0, t1), (e0, e1), _ = split_ranges("7,2,1", len(reader))
        assert np.array_equal(got_train.tokens, np.concatenate([reader[i] for i in range(t0, t1)]))
        assert np.array_equal(got_eval.tokens, np.concatenate([reader[i] for i in range(e0, e1)]))
        assert np.array_equal(np.diff(got_train.doc_starts), reader.sequence_lengths[t0:t1])
    ds = dataset_of(train_part, 32, packing=True)
    assert isinstance(ds, BlendedDataset) and len(ds) > 0
    counts = np.bincount(ds.source[: len(ds)], minlength=2)
    assert abs(counts[0] / len(ds) - 0.25) < 0.05  # the weights, as Megatron draws them
    sample = ds[0]
    part = ds.parts[int(ds.source[0])]
    assert np.array_equal(sample, part[int(ds.within[0])]) and len(sample) == 33


def test_preprocess_then_train_through_data_path(tmp_path, capsys):
    """`fivefold preprocess` (Megatron's preprocess_data flags) writes PREFIX_text_document.bin/.idx,
    which megatron-core reads back, and a Megatron command line trains on it."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"doc {i} " + "abc def " * (i % 9 + 3)}) + "\n" for i in range(60)))
    prefix = str(tmp_path / "corpus")
    assert main(["preprocess", "--input", str(src), "--output-prefix", prefix, "--append-eod", "--workers", "4"]) == 0
    corpus = open_corpus(prefix + "_text_document")
    reader = IndexedDataset(prefix + "_text_document")
    assert len(reader) == 60 and int(reader[0][-1]) == 0  # one sequence per record, ending in EOD (byte: 0)
    assert np.array_equal(corpus.tokens, np.concatenate([reader[i] for i in range(len(reader))]))
    words = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
             "--train-iters", "2", "--lr", "1e-3", "--data-path", prefix + "_text_document", "--split", "9,1,0"]
    cfg = load_config(None, words).config
    data_dir = prepare(cfg, tmp_path / "out")
    result = train(cfg, one_process_context(tmp_path / "out"), data_dir, progress=False)
    assert sorted(result.losses) == [0, 1] and all(np.isfinite(list(result.losses.values())))


def test_preprocess_stopped_by_bad_input_leaves_the_earlier_dataset_whole(tmp_path, capsys):
    """A rerun of `preprocess` into the same --output-prefix that meets a bad record (or is stopped)
    leaves the earlier PREFIX_text_document.bin/.idx as they were: the new files are written under
    another name and renamed over them once complete (the .bin used to be truncated at the start and
    left beside the old .idx). The message names preprocess's own flags, not training's config keys."""
    src, prefix = tmp_path / "docs.jsonl", str(tmp_path / "corpus")
    src.write_text("".join(json.dumps({"text": f"doc {i} abc"}) + "\n" for i in range(5)))
    assert main(["preprocess", "--input", str(src), "--output-prefix", prefix]) == 0
    written = {p.name: p.read_bytes() for p in tmp_path.glob("corpus_*")}
    assert sorted(written) == ["corpus_text_document.bin", "corpus_text_document.idx"]
    capsys.readouterr()
    src.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text key"}) + "\n")
    assert main(["preprocess", "--input", str(src), "--output-prefix", prefix]) == 2
    assert "docs.jsonl:2: no field 'text' (found ['body']); set --json-keys to the field" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in tmp_path.glob("corpus_*")} == written
    (tmp_path / "empty").mkdir()
    assert main(["preprocess", "--input", str(tmp_path / "empty"), "--output-prefix", prefix]) == 2
    assert f"--input={str(tmp_path / 'empty')!r}: the folder holds no files" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in tmp_path.glob("corpus_*")} == written
    # a folder of them (--input's help: "a .jsonl, a text file or a folder of them"): was refused as
    # "data.format='folder'" (the resolved format passed back as a given one)
    (tmp_path / "empty" / "a.jsonl").write_text(json.dumps({"text": "ab"}) + "\n" + json.dumps({"text": "c"}) + "\n")
    (tmp_path / "empty" / "b.txt").write_text("de")
    assert main(["preprocess", "--input", str(tmp_path / "empty"), "--output-prefix", prefix]) == 0
    reader = IndexedDataset(prefix + "_text_document")
    assert [bytes(reader[i].astype(np.uint8)) for i in range(len(reader))] == [b"ab", b"c", b"de"]  # byte ids
    assert sorted(p.name for p in tmp_path.glob("corpus_*")) == sorted(written)  # no partial file left


def _records(path, n: int = 3, **extra) -> str:
    path.write_text("".join(json.dumps({"text": f"doc {i} abc", **extra}) + "\n" for i in range(n)))
    return str(path)


def test_preprocess_refuses_a_folder_where_an_output_file_goes(tmp_path, capsys):
    """A folder named PREFIX_text_document.bin: refused before any work, naming it (it was an
    IsADirectoryError traceback from the final rename, exit 1, with the .partial files left behind)."""
    src = _records(tmp_path / "docs.jsonl")
    (tmp_path / "o_text_document.bin").mkdir()
    assert main(["preprocess", "--input", src, "--output-prefix", str(tmp_path / "o")]) == 2
    assert f"{tmp_path / 'o_text_document.bin'} is a folder" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "o_text_document.bin"]


def test_preprocess_refuses_an_output_prefix_under_a_file(tmp_path, capsys):
    """--output-prefix FILE/o: refused naming the file (was a FileExistsError traceback from mkdir); a
    prefix in folders that do not exist yet makes them, and a run that fails takes them away again."""
    src = _records(tmp_path / "docs.jsonl")
    (tmp_path / "file").write_text("")
    assert main(["preprocess", "--input", src, "--output-prefix", str(tmp_path / "file" / "o")]) == 2
    assert f"{tmp_path / 'file'} is not a folder" in capsys.readouterr().err
    assert main(["preprocess", "--input", src, "--output-prefix", str(tmp_path / "a" / "b" / "o"),
                 "--json-keys", "body"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "file"]
    assert main(["preprocess", "--input", src, "--output-prefix", str(tmp_path / "a" / "b" / "o")]) == 0
    assert len(IndexedDataset(str(tmp_path / "a" / "b" / "o_text_document"))) == 3


def test_preprocess_refuses_an_empty_output_prefix(tmp_path, monkeypatch, capsys):
    """--output-prefix '' (or one ending in '/') would name the files _text_document.bin: refused."""
    monkeypatch.chdir(tmp_path)
    src = _records(tmp_path / "docs.jsonl")
    for prefix in ("", "runs/"):
        assert main(["preprocess", "--input", src, "--output-prefix", prefix]) == 2
        assert f"--output-prefix {prefix!r}: the files would be named {prefix}_text_document.bin" in \
            capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["docs.jsonl"]


def test_preprocess_refuses_text_that_is_not_utf8(tmp_path, capsys):
    """Latin-1 or binary input is refused naming the file, line and byte offset of the first bad byte,
    as Megatron's tools/preprocess_data.py (strict UTF-8) fails; its bytes used to become U+FFFD
    silently. Training's own reader still reads such bytes as U+FFFD."""
    from fivefold.data.sources import read_documents

    (tmp_path / "latin.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)) * 4)  # 0..127 ASCII (a newline at 10), then 0x80
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.txt").write_text("fine")
    (tmp_path / "folder" / "b.txt").write_bytes(b"caf\xe9")
    for name, says in (("latin.jsonl", "latin.jsonl:2: not UTF-8 text (byte offset 28: e9"),
                       ("binary.txt", "binary.txt:2: not UTF-8 text (byte offset 128: 80"),
                       ("folder", "b.txt:1: not UTF-8 text (byte offset 3: e9")):
        assert main(["preprocess", "--input", str(tmp_path / name), "--output-prefix", str(tmp_path / "o")]) == 2
        assert says in capsys.readouterr().err
    assert not list(tmp_path.glob("o_*"))
    assert list(read_documents(str(tmp_path / "folder"), "auto")) == ["fine", "caf\ufffd"]


def test_preprocess_refuses_tokenizer_flags_that_do_not_go_together(tmp_path, capsys):
    """--merge-file without --vocab-file was dropped (the byte tokenizer used); GPT-2's files with
    HuggingFaceTokenizer, or --tokenizer-model with GPT-2's files, would be ignored: all refused."""
    src, out = _records(tmp_path / "docs.jsonl"), str(tmp_path / "o")
    for flags, says in ((["--merge-file", "m.txt"], "--vocab-file vocab.json and --merge-file merges.txt together "
                                                    "(--merge-file m.txt was given alone)"),
                        (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path),
                          "--vocab-file", "v.json"], "--vocab-file v.json: GPT-2's BPE files go with GPT2BPETokenizer"),
                        (["--vocab-file", "v.json", "--merge-file", "m.txt", "--tokenizer-model", str(tmp_path)],
                         f"--tokenizer-model {tmp_path}: that is HuggingFaceTokenizer's flag")):
        assert main(["preprocess", "--input", src, "--output-prefix", out, *flags]) == 2
        assert says in capsys.readouterr().err
    assert not list(tmp_path.glob("o_*"))


def test_preprocess_refuses_a_json_key_given_twice(tmp_path, capsys):
    """--json-keys text text wrote PREFIX_text_document twice, one over the other: refused."""
    src = _records(tmp_path / "docs.jsonl")
    assert main(["preprocess", "--input", src, "--output-prefix", str(tmp_path / "o"), "--json-keys", "text",
                 "text"]) == 2
    assert "--json-keys text text: 'text' given more than once" in capsys.readouterr().err
    assert not list(tmp_path.glob("o_*"))


def test_preprocess_refuses_a_json_key_that_cannot_be_a_file_name(tmp_path, capsys):
    """--json-keys a/b named the files PREFIX_a/b_document.bin: written into a folder PREFIX_a when
    one was there, else a "cannot write ... free space there" message. Refused before any work,
    naming the key and a name that would do; nothing is written."""
    src = tmp_path / "docs.jsonl"
    src.write_text(json.dumps({"a/b": "doc abc"}) + "\n")
    (tmp_path / "o_a").mkdir()
    assert main(["preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "o"), "--json-keys",
                 "a/b"]) == 2
    err = capsys.readouterr().err
    assert "--json-keys a/b: a key is part of the file names" in err
    assert "cannot hold '/'; rename the field in the JSON records (e.g. to 'a_b') and give --json-keys a_b" in err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["docs.jsonl", "o_a"]


def test_preprocess_stopped_at_a_later_key_leaves_no_dataset_of_any_key(tmp_path, capsys):
    """--json-keys text title on records without 'title': the text dataset was written (renamed into
    place) before title failed. Now every key's files are renamed only once all keys are complete, so
    the failure leaves the earlier datasets of the prefix as they were and no new or partial file."""
    src, prefix = _records(tmp_path / "docs.jsonl", title="t"), str(tmp_path / "o")
    assert main(["preprocess", "--input", src, "--output-prefix", prefix, "--json-keys", "text", "title"]) == 0
    written = {p.name: p.read_bytes() for p in tmp_path.glob("o_*")}
    assert sorted(written) == ["o_text_document.bin", "o_text_document.idx",
                               "o_title_document.bin", "o_title_document.idx"]
    capsys.readouterr()
    _records(tmp_path / "docs.jsonl", n=5)  # new text, no title
    assert main(["preprocess", "--input", src, "--output-prefix", prefix, "--json-keys", "text", "title"]) == 2
    assert "docs.jsonl:1: no field 'title'" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in tmp_path.glob("o_*")} == written
    assert main(["preprocess", "--input", src, "--output-prefix", str(tmp_path / "new"), "--json-keys", "text",
                 "title"]) == 2
    assert not list(tmp_path.glob("new_*"))


def test_preprocess_that_cannot_write_names_the_file_and_the_reason(tmp_path, monkeypatch, capsys):
    """A disk that fills (or a quota) while the dataset is written was an OSError traceback: one
    message naming the file and the OS's reason; no partial file is left, an earlier dataset stays."""
    import errno

    from fivefold.cli import preprocess

    src, prefix = _records(tmp_path / "docs.jsonl"), str(tmp_path / "o")
    assert main(["preprocess", "--input", src, "--output-prefix", prefix]) == 0
    written = {p.name: p.read_bytes() for p in tmp_path.glob("o_*")}

    class DiskFull(IndexedDatasetBuilder):
        def add_document(self, tensor, lengths, modes=None):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(preprocess, "_builder_class", lambda: DiskFull)
    capsys.readouterr()
    assert main(["preprocess", "--input", src, "--output-prefix", prefix]) == 2
    assert capsys.readouterr().err == (f"error: --output-prefix {prefix}: cannot write {prefix}_text_document.partial.bin "
                                       "(No space left on device); the partial files were removed: free space there "
                                       "or give another --output-prefix\n")
    assert {p.name: p.read_bytes() for p in tmp_path.glob("o_*")} == written


def test_broken_corpora_are_refused_naming_the_file(tmp_path):
    good = _write(tmp_path / "good", _docs(2, 10))
    idx, binary = (tmp_path / "good.idx").read_bytes(), (tmp_path / "good.bin").read_bytes()
    for name, idx_bytes, bin_bytes, says in (("short-idx", idx[:30], binary, "short-idx.idx: not a readable"),
                                             ("bad-header", b"x" * 40, binary, "bad-header.idx: not a readable"),
                                             ("short-bin", idx, binary[:20], "short-bin.bin: 20 bytes"),
                                             ("empty-bin", idx, b"", "empty-bin.bin is empty")):
        (tmp_path / f"{name}.idx").write_bytes(idx_bytes)
        (tmp_path / f"{name}.bin").write_bytes(bin_bytes)
        with pytest.raises(UserError, match=says.replace(".", r"\.")):
            open_corpus(str(tmp_path / name))
    for path, says in ((f"0.5 {good} 0.5", "even number"), (f"half {good} 0.5 {good}", "not a weight"),
                       (f"0.5 {good} 0.5 {tmp_path / 'missing'}", "no indexed dataset")):
        cfg = load_config(None, ["--data-path", *path.split()]).config
        with pytest.raises(UserError, match=says):
            prepare(cfg, tmp_path / "out")
    with pytest.raises(UserError, match="data.split"):
        split_ranges("a,b", 10)
    assert main(["validate", "--data-path", good, "--tokenizer-type", "HuggingFaceTokenizer"]) == 2


def test_a_prefix_missing_half_is_named(tmp_path):
    """PREFIX.bin without its .idx was "no such file or folder (give a text file...)"."""
    good = _write(tmp_path / "good", _docs(2, 10))
    _write(tmp_path / "half", _docs(3, 10))
    (tmp_path / "half.idx").unlink()
    half = str(tmp_path / "half")
    for path, fmt in ((half, "auto"), (half, "indexed"), (f"0.5 {good} 0.5 {half}", "auto")):
        cfg = load_config(None, ["--data-path", *path.split(), f"data.format={fmt}"]).config
        with pytest.raises(UserError, match=r"half\.bin was found but .*half\.idx is missing.*fivefold preprocess"):
            prepare(cfg, tmp_path / "out")


def test_indexed_data_rewritten_is_checked_again(tmp_path):
    """The cache in OUT/data records the .bin / .idx it was built from: rewritten with an id >=
    model.vocab_size, a rerun into the same --out is refused as a fresh one is."""
    prefix = _write(tmp_path / "c", _docs(2, 10))
    cfg = lambda: load_config(None, ["--data-path", prefix, "model.vocab_size=256"]).config  # noqa: E731
    prepare(cfg(), tmp_path / "out")
    _write(tmp_path / "c", _docs(2, 10, vocab=300) + [np.array([299, 0])])
    with pytest.raises(UserError, match="holds token id 299 >= model.vocab_size=256"):
        prepare(cfg(), tmp_path / "out")


def test_mock_data_is_megatrons_mock_corpus(tmp_path):
    """--mock-data: the sequences of megatron-core's MockGPTLowLevelDataset (same seeded lengths and
    tokens), Megatron's --split over its 100000 sequences, only the ones the run reads made."""
    import types

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset
    cfg = load_config(None, ["--mock-data", "--split", "98,2,0", "--vocab-size", "512", "--seq-length", "64",
                             "--global-batch-size", "8", "--train-iters", "3", "--eval-interval", "3",
                             "--eval-iters", "1"]).config
    assert cfg.data.mock_data
    train_part, eval_part = load_splits(prepare(cfg, tmp_path), cfg.data.eval_fraction)
    theirs = MockGPTLowLevelDataset(types.SimpleNamespace(vocab_size=512, eod=0))  # the byte tokenizer's EOD
    (t0, _), (e0, _), _ = split_ranges("98,2,0", len(theirs))
    for part, first in ((train_part, t0), (eval_part, e0)):
        n = len(part.doc_starts) - 1
        assert np.array_equal(part.tokens, np.concatenate([theirs[first + i] for i in range(n)]))
        assert len(part.tokens) >= 8 * 64 + 65  # enough for the run's samples
