"""Faults a hostile environment brings, each refused with a message and no traceback: bytes flipped
in a checkpoint, two runs into one output folder, a full disk or read-only folder at each write site,
a start-up slow enough to be taken for a hang, a rank stopped after it."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from fivefold.checkpoint.checksum import CHUNK_BYTES, METADATA_SUM
from fivefold.checkpoint.io import load_checkpoint, save_checkpoint
from fivefold.cli import main
from fivefold.config.schema import ModelConfig
from fivefold.errors import UserError
from fivefold.model.decoder import Decoder

FLIPS = 100


def _tiny_model(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256))


def _saved(root: Path) -> tuple[Path, Decoder]:
    """A one-process checkpoint of the tiny model after one AdamW step: model, optimizer, RNG files."""
    model = _tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    model(torch.randint(0, 256, (2, 64))).float().square().mean().backward()
    opt.step()
    folder = save_checkpoint(root, 1, model=model, optimizer=opt, rank=0, writes_params=True, barrier=lambda: None,
                             extra={"optimizer_step": 1, "world_size": 1})
    return folder, model


def _load(folder: Path) -> Decoder:
    model = _tiny_model(seed=1)
    load_checkpoint(folder, model=model, optimizer=torch.optim.AdamW(model.parameters()), rank=0, world_size=1)
    return model


def _offset(rng: random.Random, path: Path) -> int:
    """Half the flips of a safetensors file in its header (length and JSON), half in its tensor data."""
    size = path.stat().st_size
    if path.suffix != ".safetensors":
        return rng.randrange(size)
    header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    return rng.randrange(header) if rng.random() < 0.5 else rng.randrange(header, size)


def test_every_single_byte_flip_is_refused_naming_the_file(tmp_path):
    """A flipped byte in tensor data trained on silently; now each of FLIPS random flips, over every
    file kind (parameters, AdamW state, RNG, headers, metadata.json and its checksum) is refused on
    load, naming the file; the clean checkpoint loads bit-exact."""
    folder, saved = _saved(tmp_path / "ckpt")
    files = sorted(p for p in folder.iterdir())
    assert {p.name for p in files} == {"model-00000.safetensors", "optim-00000.safetensors", "rng-00000.safetensors",
                                       "metadata.json", METADATA_SUM}
    rng = random.Random(61)
    for _ in range(FLIPS):
        path = rng.choice(files)
        original = path.read_bytes()
        at = _offset(rng, path)
        damaged = bytearray(original)
        damaged[at] ^= rng.randrange(1, 256)
        path.write_bytes(bytes(damaged))
        try:
            with pytest.raises(UserError) as refused:
                _load(folder)
            named = "metadata" if path.name == METADATA_SUM else path.name
            assert named in str(refused.value) and "load the checkpoint before it" in str(refused.value), \
                (path.name, at, str(refused.value))
        finally:
            path.write_bytes(original)
    loaded = _load(folder)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), saved.state_dict().values()))


def test_a_resharded_read_verifies_only_the_blocks_it_reads(tmp_path):
    """A reader checks the blocks of CHUNK_BYTES its rows lie in: damage in rows it does not read is
    not its concern (the rank that reads them refuses it), damage in its own rows is named with the tensor."""
    from fivefold.checkpoint.checksum import expected
    from fivefold.checkpoint.io import read_metadata
    from fivefold.checkpoint.layout import ShardSpec
    from fivefold.checkpoint.reshard import Reader, checkpoint_source, fill

    model = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB of fp32: four checksummed blocks
    opt = torch.optim.AdamW(model.parameters())
    folder = save_checkpoint(tmp_path, 0, model=model, optimizer=opt, rank=0, writes_params=True,
                             barrier=lambda: None, extra={})
    file = folder / "model-00000.safetensors"
    data = bytearray(file.read_bytes())
    data[-1] ^= 1  # the last row's last byte: the fourth block
    file.write_bytes(bytes(data))
    _, meta = read_metadata(folder)
    source = checkpoint_source(folder, meta)["weight"]
    first = torch.empty(256, 1024)  # rows 0..255: the first block only
    with Reader(expected(folder, meta)) as reader:
        assert fill(first, ShardSpec((1024, 1024), (0, 0)), source, reader)
    assert torch.equal(first, model.weight.data[:256])
    last = torch.empty(256, 1024)
    with Reader(expected(folder, meta)) as reader, pytest.raises(UserError, match=(
            rf"model-00000.safetensors: tensor weight \(bytes {3 * CHUNK_BYTES}-{4 * CHUNK_BYTES}\) does not match")):
        fill(last, ShardSpec((1024, 1024), (768, 0)), source, reader)


def test_check_verifies_a_whole_checkpoint_and_a_checkpoint_without_checksums_still_loads(tmp_path, capsys):
    folder, _ = _saved(tmp_path / "ckpt")
    assert main(["check", str(tmp_path / "ckpt")]) == 0
    assert "ok (metadata.json and 3 files" in capsys.readouterr().out
    rng_file = folder / "rng-00000.safetensors"  # a file load reads only at the same world size
    data = bytearray(rng_file.read_bytes())
    data[-3] ^= 0x10
    rng_file.write_bytes(bytes(data))
    assert main(["check", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "rng-00000.safetensors: tensor torch_cpu" in err and "does not match its checksum" in err
    assert "Traceback" not in err
    older = tmp_path / "older"  # saved before checksums: no metadata.crc32, no `checksums` key
    folder, saved = _saved(older)
    meta = json.loads((folder / "metadata.json").read_text())
    del meta["checksums"]
    (folder / "metadata.json").write_text(json.dumps(meta))
    (folder / METADATA_SUM).unlink()
    assert main(["check", str(folder)]) == 0
    assert "saved without checksums" in capsys.readouterr().out
    loaded = _load(folder)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), saved.state_dict().values()))
    shutil.rmtree(older)
