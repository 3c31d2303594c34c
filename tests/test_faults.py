"""Faults a hostile environment brings, each refused with a message and no traceback: bytes flipped
in a checkpoint, two runs into one output folder, a full disk or read-only folder at each write site,
a start-up slow enough to be taken for a hang, a rank stopped after it."""
from __future__ import annotations

import errno
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _train_util import corpus, tiny_config
from fivefold.checkpoint.checksum import CHUNK_BYTES, METADATA_SUM
from fivefold.checkpoint.io import load_checkpoint, save_checkpoint
from fivefold.cli import main
from fivefold.config.schema import Config, ModelConfig, to_dict
from fivefold.errors import UserError
from fivefold.model.decoder import Decoder

FLIPS = 100


def _tiny_model(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256))


def _saved(root: Path) -> tuple[Path, Decoder]:
    """A one-process checkpoint of the tiny model after one AdamW step: model, optimizer, RNG files, and
    its config (for `convert` and `export`)."""
    model = _tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    model(torch.randint(0, 256, (2, 64))).float().square().mean().backward()
    opt.step()
    folder = save_checkpoint(root, 1, model=model, optimizer=opt, rank=0, writes_params=True, barrier=lambda: None,
                             extra={"optimizer_step": 1, "world_size": 1, "config": to_dict(Config(model=model.cfg))})
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


def _run_config(tmp_path: Path, steps: int, save_interval: int) -> Path:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"""cluster: {{world_size: 2}}
parallel: {{tensor_model_parallel_size: 2, sequence_parallel: true}}
model: {{num_layers: 2, hidden_size: 64, num_attention_heads: 4, num_query_groups: 2}}
training: {{seq_length: 64, global_batch_size: 2, micro_batch_size: 1, train_iters: {steps}, lr: 3.0e-3}}
data: {{path: {corpus(tmp_path / 'corpus')}, eval_fraction: 0.1}}
checkpoint: {{save_interval: {save_interval}}}
""")
    return cfg


def _wait_for(what, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.1)


def _hold(folder: Path, command: str = "train") -> subprocess.Popen:
    """A process that holds `folder`'s lock as a running `fivefold COMMAND` does (fivefold.cli._lock) and
    sleeps: the lock without the cost of a run; returns once the lock is held and names its holder."""
    folder.mkdir(parents=True, exist_ok=True)
    code = ("import pathlib, time; from fivefold.cli._lock import holding\n"
            f"with holding('--out', pathlib.Path({str(folder)!r}), {command!r}):\n"
            "    print('held', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def _lock_seen(out: Path, seen: list[bool], done) -> None:
    """While `done` is unset: record whether `out`'s lock is held by someone (a run in this process too:
    flock conflicts between open files, not only between processes)."""
    from fivefold.cli._lock import refuse_if_held

    while not done.wait(0.05):
        try:
            refuse_if_held("--out", out)
        except UserError:
            seen.append(True)


def test_one_run_per_output_folder_and_a_damaged_checkpoint_is_refused_by_train(tmp_path, capsys):
    """Two runs into one --out both started and wrote the same files: a second `train` into a held --out
    is refused before any rank starts, naming the holder's host and pid; after kill -9 of the holder the
    next run starts (the lock died with it) and holds --out while it runs. That run --load's a checkpoint
    with a flipped byte, which its ranks refuse (they trained on before); `check` finds the one before whole."""
    import threading

    import yaml

    from _train_util import train_one_process
    from fivefold.config.schema import to_dict

    config = tiny_config(corpus(tmp_path / "corpus"), world=1, gbs=2, steps=2)
    config.checkpoint.save_interval = 1
    train_one_process(config, tmp_path / "saved")  # checkpoints step 1 and 2, in this process: no ranks to start
    root = tmp_path / "saved" / "one" / "checkpoints"
    cfg, out = tmp_path / "run.yaml", tmp_path / "out"
    cfg.write_text(yaml.safe_dump(to_dict(config)))
    holder = _hold(out)
    try:
        began = time.monotonic()
        assert main(["train", str(cfg), "--out", str(out)]) == 2
        refused = time.monotonic() - began
        err = capsys.readouterr().err
        assert f"--out {out}: in use by a running `fivefold train` (host {socket.gethostname()}, pid {holder.pid}" in err
        assert refused < 5, refused  # before the config is read: nothing waits
    finally:
        holder.kill()  # kill -9: the kernel releases its flock
        holder.wait()
    latest = root / (root / "latest").read_text()
    before = sorted(p for p in root.glob("step_*") if p != latest)[-1]
    model = latest / "model-00000.safetensors"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit in the middle of a tensor
    model.write_bytes(bytes(data))
    seen, done = [], threading.Event()
    watcher = threading.Thread(target=_lock_seen, args=(out, seen, done))
    watcher.start()
    try:
        assert main(["train", str(cfg), "--out", str(out), f"checkpoint.load={root}", "training.train_iters=4"]) == 2
    finally:
        done.set()
        watcher.join()
    assert seen, "the run did not hold --out's lock"
    err = capsys.readouterr().err
    assert "model-00000.safetensors: tensor" in err and "does not match its checksum" in err, err
    assert "Traceback" not in err + "".join(p.read_text() for p in (out / "logs").glob("rank-*.log"))
    assert main(["check", str(root)]) == 2 and main(["check", str(before)]) == 0  # the one before is whole


def _enospc(path=None):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path) if path else None)


def _full_after_half(path: Path, data: bytes = b"x" * 4096):
    """What a full disk leaves: half a file, then ENOSPC."""
    Path(path).write_bytes(data[:len(data) // 2])
    raise _enospc(path)


def _checkpoint_root(tmp_path: Path) -> tuple[Path, Decoder, torch.optim.Optimizer]:
    _, model = _saved(tmp_path / "ckpt")
    return tmp_path / "ckpt", model, torch.optim.AdamW(model.parameters(), foreach=False)


def _assert_previous_stays(root: Path) -> None:
    assert (root / "latest").read_text() == "step_00000001"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]  # nothing partial
    _load(root)


@pytest.mark.parametrize("site", ["model file", "metadata", "async writer", "async staging"])
def test_a_full_disk_while_saving_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch, site):
    import fivefold.checkpoint.async_save as async_save
    import fivefold.checkpoint.io as io

    root, model, opt = _checkpoint_root(tmp_path)
    kw = dict(model=model, optimizer=opt, writes_params=True, extra={"optimizer_step": 2, "world_size": 1})
    if site == "model file":
        monkeypatch.setattr(io, "save_file", lambda tensors, path: _full_after_half(path))
    elif site == "metadata":
        monkeypatch.setattr(io, "write_metadata", lambda folder, meta: _full_after_half(folder / "metadata.json"))
    elif site == "async writer":
        monkeypatch.setattr(async_save, "_save", lambda tensors, path: _full_after_half(path))
    else:
        monkeypatch.setattr(io, "save_optim", lambda folder, tag, *a: _full_after_half(folder / f"optim-{tag}.json"))
    with pytest.raises(UserError, match="step_00000001 stays latest.*No space left on device"):
        if site.startswith("async"):
            saver = async_save.AsyncSaver(0, lambda: None)
            saver.save(root, 2, **kw)
            saver.finish()
        else:
            save_checkpoint(root, 2, rank=0, barrier=lambda: None, **kw)
    _assert_previous_stays(root)


def _save_with_rank_1_full(rank: int, world: int, root: str) -> str:
    """On 2 gloo ranks: rank 1's disk is full while it writes its model file."""
    import torch.distributed as dist

    import fivefold.checkpoint.io as io

    def all_ok(ok: bool) -> bool:
        bad = torch.tensor([0.0 if ok else 1.0])
        dist.all_reduce(bad)
        return float(bad) == 0
    real = io.save_file
    if rank == 1:
        io.save_file = lambda tensors, path: _full_after_half(path)
    model = _tiny_model()
    try:
        save_checkpoint(root, 2, model=model, optimizer=torch.optim.AdamW(model.parameters()), rank=rank,
                        writes_params=True, barrier=dist.barrier, all_ok=all_ok, extra={})
    except UserError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        io.save_file = real
    return "saved"


def test_a_full_disk_on_one_rank_ends_the_save_on_every_rank(tmp_path, workers):
    """The rank whose disk is full names it; the other stops at the same point with a line saying so
    (it waited in a collective for a rank that had died: a traceback in its log, before)."""
    root, _, _ = _checkpoint_root(tmp_path)
    said = workers(2).run(_save_with_rank_1_full, str(root))
    assert said[0].startswith("PeerFailed: checkpoint 2: another rank could not write its files"), said
    assert said[1].startswith("WriteFailed: cannot write") and "No space left on device" in said[1], said
    _assert_previous_stays(root)


def test_a_full_disk_is_named_at_every_other_write_site(tmp_path, monkeypatch):
    """Preparing the data, metrics.jsonl, the loss curve, convert, export: a message naming the file
    and the fix, the partial files removed, what was there before left as it was."""
    import matplotlib.figure

    import fivefold.data.dataset as dataset
    from fivefold.cli.train import prepare
    from fivefold.train.metrics import MetricsLog, plot_loss_curve

    config = tiny_config(corpus(tmp_path / "corpus"))
    real = dataset._write_split
    monkeypatch.setattr(dataset, "_write_split", lambda folder, name, *a: (real(folder, name, *a),
                                                                          _full_after_half(folder / f"{name}.bin")))
    with pytest.raises(UserError, match=r"cannot write .*train.bin \(the tokenized training data\): No space left"):
        prepare(config, tmp_path / "run")
    assert not list((tmp_path / "run").glob("data*"))
    monkeypatch.setattr(dataset, "_write_split", real)

    log = MetricsLog(tmp_path / "run", tensorboard=False)
    log.write({"step": 0, "loss": 5.0})

    class Full:
        def write(self, text):
            raise _enospc()
        flush = close = lambda self: None
    log.file = Full()
    with pytest.raises(UserError, match="metrics.jsonl \\(the run's metrics; the lines before this step are in it\\)"):
        log.write({"step": 1, "loss": 4.0})
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, path, **kw: _full_after_half(path))
    with pytest.raises(UserError, match="loss.png \\(the loss curve"):
        plot_loss_curve(tmp_path / "run" / "metrics.jsonl", tmp_path / "run" / "loss.png")
    assert not (tmp_path / "run" / "loss.png").exists()


def test_a_full_disk_under_tensorboard_or_wandb_is_named_at_the_step(tmp_path, monkeypatch, capsys):
    """TensorBoard writes its events in a thread: a full disk there printed that thread's traceback and
    training went on without its logs. Now the step's metrics line names the file, no traceback; W&B's too."""
    from tensorboard.compat.tensorflow_stub.io import gfile

    from fivefold.train.metrics import MetricsLog

    (tmp_path / "run").mkdir()
    log = MetricsLog(tmp_path / "run", tensorboard=True)
    log.write({"step": 0, "loss": 5.0})

    def full(self, content):
        with open(self.filename, "ab") as f:
            f.write(content[:len(content) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.filename)  # (a bytes name, as io.open's)
    monkeypatch.setattr(gfile.GFile, "write", full)
    with pytest.raises(UserError, match=r"cannot write /.*tensorboard/events.out.tfevents.* \(the TensorBoard logs; "
                                        r"metrics.jsonl has every step's numbers\): No space left on device"):
        log.write({"step": 1, "loss": 4.0})
        log.close()  # (the thread's failure reached the main thread after this step's flush returned: said here)
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 2  # metrics.jsonl has the step
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err

    class OfflineRun:  # wandb's run as far as MetricsLog uses it (the wandb package is optional)
        def log(self, scalars, step):
            raise _enospc(tmp_path / "run" / "wandb" / "offline-run" / "run.wandb")
        finish = lambda self: None
    monkeypatch.setitem(sys.modules, "wandb", type(sys)("wandb"))
    sys.modules["wandb"].init = lambda **kw: OfflineRun()
    log = MetricsLog(tmp_path / "run", tensorboard=False, wandb_project="p")
    with pytest.raises(UserError, match=r"run.wandb \(the W&B offline run; metrics.jsonl has every step's numbers\)"):
        log.write({"step": 0, "loss": 5.0})


def test_a_full_disk_at_the_data_cache_meta_and_the_pipeline_trace_is_named(tmp_path, monkeypatch, capsys):
    """The data cache's meta.json (written last, so a cache without it is never reused) and the
    pipeline's timeline picture (`schedule --png`, and OUT/schedule_trace.png of a traced step): the
    file named, exit 2 without a traceback, nothing partial left."""
    import matplotlib.figure

    import fivefold.data.dataset as dataset
    from fivefold.cli.train import prepare

    config = tiny_config(corpus(tmp_path / "corpus"))
    monkeypatch.setattr(dataset, "_write_meta", lambda folder, meta: _full_after_half(folder / "meta.json"))
    with pytest.raises(UserError, match=r"cannot write .*meta.json \(the tokenized training data\): No space left"):
        prepare(config, tmp_path / "run")
    assert not list((tmp_path / "run").glob("data*"))
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, path, **kw: _full_after_half(path))
    png = tmp_path / "timeline.png"
    assert main(["schedule", "--pp", "2", "--microbatches", "4", "--png", str(png)]) == 2
    err = capsys.readouterr().err
    assert f"cannot write {png} (the pipeline timeline picture): No space left on device" in err, err
    assert "Traceback" not in err and not png.exists()
    from fivefold.errors import writing_file

    text = tmp_path / "schedule_trace.txt"  # as the training loop writes it (a traced step needs PP ranks)
    with pytest.raises(UserError, match="schedule_trace.txt \\(the measured pipeline timeline\\): No space left"):
        with writing_file(text, "the measured pipeline timeline"):
            _full_after_half(text)
    assert not text.exists()


def _tree(folder: Path) -> list:
    return sorted((str(p.relative_to(folder)), p.read_bytes() if p.is_file() else None) for p in folder.rglob("*"))


@pytest.mark.parametrize("site", ["convert: model file", "convert: metadata", "export: shards", "export: config"])
def test_a_full_disk_in_convert_and_export_leaves_the_destination_as_it_was(tmp_path, monkeypatch, capsys, site):
    """Through the CLI: exit 2, the file named, no traceback, DST / OUT_DIR as before the command (no
    folder where there was none; an earlier export kept whole)."""
    import fivefold.checkpoint.convert as convert
    import fivefold.hf.export as export

    root, _, _ = _checkpoint_root(tmp_path)
    out = tmp_path / "dst"
    if site.startswith("export"):
        assert main(["export", str(root), str(out)]) == 0  # an earlier export: the next one replaces it whole
    if site == "convert: model file":
        monkeypatch.setattr(convert, "write_streaming", lambda path, *a, **k: _full_after_half(path))
    elif site == "convert: metadata":
        monkeypatch.setattr(convert, "write_metadata", lambda folder, meta: _full_after_half(folder / "metadata.json"))
    elif site == "export: shards":
        monkeypatch.setattr(export, "_write_shards", lambda folder, shards: _full_after_half(folder / "model.safetensors"))
    if site.startswith("convert"):
        argv = ["convert", str(root), str(out), "--tensor-model-parallel-size", "2", "--world-size", "2"]
        named = "model-00000.safetensors" if "model" in site else "metadata.json"
    else:
        if site == "export: config":
            real = Path.write_text
            monkeypatch.setattr(Path, "write_text", lambda self, text, *a, **k: _full_after_half(self) if
                                self.name == "config.json" else real(self, text, *a, **k))
        argv, named = ["export", str(root), str(out)], "model.safetensors" if "shards" in site else "config.json"
    before = _tree(tmp_path)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{named} (the {site.split(':')[0] if site.startswith('export') else 'converted checkpoint'}; {out} is " \
           "left as it was): No space left on device" in err, err
    assert "Traceback" not in err
    assert _tree(tmp_path) == before  # nothing partial beside it, the earlier export whole


def test_a_second_rl_into_a_held_out_is_refused_naming_the_holder(tmp_path, capsys):
    out = tmp_path / "rl"
    holder = _hold(out, "rl")
    try:
        assert main(["rl", "examples/grpo.yaml", "--out", str(out), "grpo.steps=1"]) == 2
        err = capsys.readouterr().err
        assert f"--out {out}: in use by a running `fivefold rl` (host {socket.gethostname()}, pid {holder.pid}" in err
        assert "Traceback" not in err and not (out / "run.json").exists()
    finally:
        holder.kill()
        holder.wait()
