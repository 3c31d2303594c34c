"""Data pipeline: tokenizers, sources and their errors, packing, layout-independent sampling."""
from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest

from fivefold.config.schema import DataConfig
from fivefold.data.dataset import DocumentDataset, PackedDataset, load_splits, prepare_data
from fivefold.data.loader import IGNORE_INDEX, BatchLoader
from fivefold.data.sampler import balanced_partition, global_batch_indices
from fivefold.data.sources import read_documents
from fivefold.data.tokenizer import ByteTokenizer, HFTokenizer
from fivefold.errors import UserError


def test_byte_tokenizer_roundtrip_and_reserved_eod():
    tok = ByteTokenizer()
    ids = tok.encode("héllo\x00!")
    assert tok.eod_id not in ids  # NUL is reserved for end of document
    assert tok.decode(ids) == "héllo!"


def test_hf_tokenizer_from_local_folder(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<unk>": 1, "hello": 2, "world": 3}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="<unk>").save_pretrained(tmp_path)
    tok = HFTokenizer(str(tmp_path))
    assert (tok.vocab_size, tok.eod_id) == (4, 0)
    assert tok.encode("hello world bye").tolist() == [2, 3, 1]
    assert tok.files == (tmp_path / "tokenizer.json", tmp_path / "tokenizer_config.json")  # what the data cache records
    (tmp_path / "empty").mkdir()  # (transformers' answer was a paragraph on slow tokenizers)
    with pytest.raises(UserError, match="no tokenizer.json or tokenizer_config.json in it"):
        HFTokenizer(str(tmp_path / "empty"))


def test_missing_path_and_malformed_jsonl_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        list(read_documents(str(tmp_path / "nope.txt"), "auto"))
    bad = tmp_path / "d.jsonl"
    bad.write_text('{"text": "ok"}\n\n{"text": oops}\n')
    with pytest.raises(UserError, match=r"d\.jsonl:3: malformed JSON"):
        list(read_documents(str(bad), "auto"))
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(UserError, match=r"d\.jsonl:1: no field 'text'.*jsonl_field"):
        list(read_documents(str(bad), "auto"))
    assert list(read_documents(str(bad), "auto", jsonl_field="body")) == ["x"]


def _corpus(tmp_path, n_docs=12):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(n_docs):
        (folder / f"{i:02d}.txt").write_text(f"document {i} " * (i + 1))
    return folder


def test_packing_concatenates_documents_with_eod(tmp_path):
    folder = _corpus(tmp_path)
    cache = prepare_data(DataConfig(path=str(folder), eval_fraction=0.25), ByteTokenizer(), tmp_path / "c", seed=3)
    train, held = load_splits(cache, 0.25)
    assert len(held.doc_starts) > 1 and len(train.doc_starts) > 1
    docs = [ByteTokenizer().decode(train.tokens[a:b - 1]) for a, b in zip(train.doc_starts[:-1], train.doc_starts[1:])]
    assert all(d.startswith("document ") for d in docs)
    assert all(train.tokens[b - 1] == 0 for b in train.doc_starts[1:])  # each document ends with EOD
    ds = PackedDataset(train, seq_length=16)
    assert len(ds) == (len(train.tokens) - 1) // 16
    assert np.array_equal(ds[1], train.tokens[16:33])  # sample i = stream[i*S : i*S+S+1]


def test_global_batches_do_not_depend_on_dp_size(tmp_path):
    cache = prepare_data(DataConfig(path=str(_corpus(tmp_path))), ByteTokenizer(), tmp_path / "c", seed=0)
    ds = PackedDataset(load_splits(cache, 0.05)[0], seq_length=8)
    for step in (0, 1, 7):  # step 7 runs past the first epoch
        reference = None
        for dp in (1, 2, 4):
            shares = [BatchLoader(ds, global_batch_size=8, micro_batch_size=1, dp_rank=r, dp_size=dp, seed=5)
                      .step_batch(step) for r in range(dp)]
            ids = np.concatenate([s.sample_ids for s in shares])
            reference = ids if reference is None else reference
            assert np.array_equal(ids, reference)
            assert all(s.global_tokens == 64 for s in shares)
    assert len(set(global_batch_indices(0, len(ds), len(ds), seed=5).tolist())) == len(ds)  # an epoch is a permutation


def _brute_force_max(w, k):
    best = None
    for cuts in itertools.combinations(range(1, len(w)), k - 1):
        b = [0, *cuts, len(w)]
        worst = max(sum(w[b[i]:b[i + 1]]) for i in range(k))
        best = worst if best is None else min(best, worst)
    return best


def test_balanced_partition_is_optimal_against_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 9))
        k = int(rng.integers(1, n + 1))
        w = rng.integers(1, 50, size=n).tolist()
        b = balanced_partition(w, k)
        assert b[0] == 0 and b[-1] == n and all(x < y for x, y in zip(b, b[1:])) and len(b) == k + 1
        assert max(sum(w[b[i]:b[i + 1]]) for i in range(k)) == _brute_force_max(w, k)


def test_unpacked_samples_split_by_tokens_across_ranks(tmp_path):
    cfg = DataConfig(path=str(_corpus(tmp_path, 20)), packing=False, eval_fraction=0.0)
    cache = prepare_data(cfg, ByteTokenizer(), tmp_path / "c", seed=0)
    ds = DocumentDataset(load_splits(cache, 0.0)[0], seq_length=64)
    shares = [BatchLoader(ds, global_batch_size=8, micro_batch_size=2, dp_rank=r, dp_size=2, seed=1).step_batch(0)
              for r in range(2)]
    per_rank = [sum(m.num_tokens for m in s.microbatches) for s in shares]
    assert sum(per_rank) == shares[0].global_tokens == shares[1].global_tokens
    # The shares are the global batch in order, cut where the larger share is smallest (brute force).
    # seq_length=256, seed=3: documents of 22..228 targets, where 4 + 4 samples would give 687, not 635.
    ds = DocumentDataset(load_splits(cache, 0.0)[0], seq_length=256)
    ids = global_batch_indices(0, 8, len(ds), seed=3)
    shares = [BatchLoader(ds, global_batch_size=8, micro_batch_size=2, dp_rank=r, dp_size=2, seed=3).step_batch(0)
              for r in range(2)]
    assert np.concatenate([s.sample_ids for s in shares]).tolist() == ids.tolist()
    assert max(sum(m.num_tokens for m in s.microbatches) for s in shares) == \
        _brute_force_max([ds.target_tokens(int(i)) for i in ids], 2) == 635
    mb = shares[0].microbatches[0]
    assert ((mb.labels == IGNORE_INDEX) == (mb.labels < 0)).all() and mb.num_tokens == int((mb.labels >= 0).sum())


def test_token_file_is_memory_mapped_and_split_by_position(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    cache = prepare_data(DataConfig(path=str(path), eval_fraction=0.1), ByteTokenizer(), tmp_path / "c", seed=0)
    assert json.loads((cache / "meta.json").read_text())["max_id"] == 999
    train, held = load_splits(cache, 0.1)
    assert isinstance(train.tokens, np.memmap) and len(train.tokens) == 900 and held.tokens[0] == 900
    with pytest.raises(UserError, match="packing=false"):
        DocumentDataset(train, 8)


def test_token_ids_outside_the_vocabulary_are_refused_before_training(tmp_path):
    """A token file's ids must index the embedding: one too large was refused; a negative one (a signed
    .npy) trained without a word before."""
    from fivefold.cli.train import prepare
    from fivefold.config.load import load_config

    for bad, said in ((-5, "holds token id -5; token ids are >= 0"),
                      (300, "holds token id 300 >= model.vocab_size=256")):
        ids = (np.arange(40_000) % 200).astype(np.int64)
        ids[100] = bad
        np.save(tmp_path / f"ids{bad}.npy", ids)
        cfg = load_config("examples/demo.yaml", [f"data.path={tmp_path / f'ids{bad}.npy'}"]).config
        with pytest.raises(UserError, match=said):
            prepare(cfg, tmp_path / f"out{bad}")


def _prepare(tmp_path, path, out: str):
    from fivefold.cli.train import prepare
    from fivefold.config.load import load_config

    return prepare(load_config("examples/demo.yaml", [f"data.path={path}"]).config, tmp_path / out)


def test_data_cache_is_rebuilt_when_its_source_file_changes(tmp_path):
    """OUT/data was keyed on the config and the path only: a rerun after the text file was rewritten
    trained on the old text, and one after a token file was rewritten with an id >= vocab_size trained
    without the vocabulary check a fresh --out runs."""
    text = tmp_path / "a.txt"
    text.write_text("hello world\n" * 50)
    cache = _prepare(tmp_path, text, "R")
    built = (cache / "meta.json").stat().st_mtime_ns
    assert _prepare(tmp_path, text, "R") == cache and (cache / "meta.json").stat().st_mtime_ns == built  # reused
    text.write_text("goodbye moon\n" * 60)
    train, _ = load_splits(_prepare(tmp_path, text, "R"), 0.0)
    assert ByteTokenizer().decode(train.tokens[:12]) == "goodbye moon"
    st = text.stat()  # the same size, rewritten later: its mtime moves (set here, not waited for)
    text.write_text("GOODBYE MOON\n" * 60)
    os.utime(text, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    train, _ = load_splits(_prepare(tmp_path, text, "R"), 0.0)
    assert ByteTokenizer().decode(train.tokens[:12]) == "GOODBYE MOON"

    ids = (np.arange(40_000) % 200).astype(np.uint16)
    np.save(tmp_path / "ids.npy", ids)
    _prepare(tmp_path, tmp_path / "ids.npy", "T")
    ids[100] = 300
    np.save(tmp_path / "ids.npy", ids)
    os.utime(tmp_path / "ids.npy", ns=(0, (tmp_path / "ids.npy").stat().st_mtime_ns + 1_000_000))
    with pytest.raises(UserError, match="holds token id 300 >= model.vocab_size=256"):
        _prepare(tmp_path, tmp_path / "ids.npy", "T")


def test_data_cache_is_rebuilt_when_its_tokenizer_file_changes(tmp_path):
    """OUT/data recorded the corpus's files but not the tokenizer's: a rerun after merges.txt (or
    vocab.json, tokenizer.json) was rewritten trained on ids of the old tokenizer."""
    from tokenizers import pre_tokenizers

    from fivefold.data.tokenizer import GPT2BPETokenizer

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}  # GPT-2's byte symbols
    vocab.update({"he": len(vocab), "<|endoftext|>": len(vocab) + 1})
    files = tmp_path / "vocab.json", tmp_path / "merges.txt"
    files[0].write_text(json.dumps(vocab))
    files[1].write_text("#version: 0.2\n")
    (tmp_path / "a.txt").write_text("hello " * 20)
    data = DataConfig(path=str(tmp_path / "a.txt"), eval_fraction=0.0)

    def first_ids() -> list[int]:
        cache = prepare_data(data, GPT2BPETokenizer(*map(str, files)), tmp_path / "c", seed=0)
        return load_splits(cache, 0.0)[0].tokens[:2].tolist()

    h, e = vocab["h"], vocab["e"]
    assert first_ids() == [h, e]
    st = files[1].stat()
    files[1].write_text("#version: 0.2\nh e\n")  # "he" one token now
    os.utime(files[1], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # (a later mtime, set, not waited for)
    assert first_ids() == [vocab["he"], vocab["l"]]


def test_failed_data_build_leaves_no_tmp_folder(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError, match="no text found"):
        _prepare(tmp_path, tmp_path / "empty.txt", "R")
    assert not (tmp_path / "R" / "data.tmp").exists()


def test_binary_files_are_refused_not_trained_on_as_text(tmp_path):
    """Random bytes, or a .png among texts, were read with errors='replace' and trained on (exit 0);
    a NUL byte or a file mostly not UTF-8 is refused naming the file and byte offset. A stray Latin-1
    letter is still read as U+FFFD, and the standard-library corpus still reads."""
    rng = np.random.default_rng(0)
    (tmp_path / "random.dat").write_bytes(b"text first " + rng.integers(0, 256, 4000, dtype=np.uint8).tobytes())
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.txt").write_text("fine")
    (folder / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (tmp_path / "greek.txt").write_bytes("καλημέρα κόσμε ".encode("iso-8859-7") * 20)  # no NUL, all > 0x7f
    for path, says in (("random.dat", r"random\.dat: a NUL byte at byte offset \d+"),
                       ("folder", r"logo\.png: a NUL byte at byte offset 8"),
                       ("greek.txt", r"greek\.txt: 260 of its 300 bytes are not UTF-8, the first at byte offset 0")):
        with pytest.raises(UserError, match=says):
            list(read_documents(str(tmp_path / path), "auto"))
        with pytest.raises(UserError, match=says):
            _prepare(tmp_path, tmp_path / path, "R")
    (folder / "logo.png").unlink()
    (folder / "b.txt").write_bytes(b"caf\xe9")
    assert list(read_documents(str(folder), "auto")) == ["fine", "caf\ufffd"]
    assert len(list(read_documents(None, "auto", max_documents=80))) == 80
