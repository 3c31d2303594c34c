"""What a folder given to --load is when it is not a fivefold checkpoint, and the damage a fivefold
checkpoint can have, each refused with the way forward.

fivefold never unpickles a file (unpickling runs arbitrary code): a folder of .pt / .bin files, and
Megatron's torch_dist / torch.distributed.checkpoint (DCP) checkpoints, whose `.metadata` is a
pickle, are refused by name; their way in is a Hugging Face safetensors folder. A checkpoint that
lists a shard file that is not there, or whose safetensors file ends before its header says it does
(a copy cut short), is refused before a byte of it is used.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

from fivefold.errors import UserError

PICKLED = (".pt", ".pth", ".bin", ".pkl", ".ckpt")
VIA_HF = ("convert it to a Hugging Face safetensors folder with the tool that wrote it (Megatron-Bridge, or "
          "Megatron-LM's tools/checkpoint/convert.py with a Hugging Face saver) and import that folder")


def _files(folder: Path, depth: int = 3) -> list[Path]:
    """Files under `folder`, at most `depth` levels down (Megatron: ROOT/iter_0000010/mp_rank_00/...)."""
    out, level = [], [folder]
    for _ in range(depth):
        nxt = []
        for d in level:
            for p in sorted(d.iterdir()):
                (nxt if p.is_dir() else out).append(p)
        level = nxt
    return out


def why_not_a_checkpoint(path: Path) -> str:
    """The sentence saying what `path` is, for a folder without a fivefold checkpoint, and what to do."""
    if not path.is_dir():
        return f"--load {path}: no complete checkpoint there: no such folder (give a checkpoint folder, or a root with step_* folders)"
    files = _files(path)
    names = {f.name for f in files}
    if ".metadata" in names or any(f.suffix == ".distcp" for f in files):
        return (f"--load {path}: a torch.distributed.checkpoint (DCP / Megatron torch_dist) checkpoint. Its "
                ".metadata file is a pickle, which fivefold does not load (unpickling runs arbitrary code): "
                + VIA_HF + ".")
    pickled = [f for f in files if f.suffix in PICKLED]
    if pickled and not any(f.suffix == ".safetensors" for f in files):
        return (f"--load {path}: only pickled files ({pickled[0].relative_to(path)}, ...): fivefold does not "
                "unpickle (it runs arbitrary code). " + VIA_HF + " (transformers: save_pretrained(..., "
                "safe_serialization=True)).")
    if any(f.suffix == ".safetensors" for f in files) and "config.json" in names:
        return (f"--load {path}: a Hugging Face model folder, not a fivefold checkpoint; import it "
                "(fivefold.model.hf) instead of resuming from it")
    return (f"--load {path}: no complete checkpoint there (a folder with metadata.json, or a root with step_* "
            "folders); a run killed during its first save leaves only a .tmp-step_* folder")


def check_files(folder: Path, meta: dict) -> None:
    """UserError naming the files the checkpoint's metadata lists that are not in `folder`, or the
    first that is not a whole safetensors file (headers only are read)."""
    listed = {s["file"] for e in meta["params"].values() for k in ("shards", "optim_shards") for s in e.get(k, [])}
    missing = sorted(f for f in listed if not (folder / f).is_file())
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UserError(f"checkpoint {folder} is missing {missing[0]}{more} (shards written by the rank in the "
                        "name): copy the whole folder again, or load an earlier checkpoint")
    for f in sorted(listed):
        check_safetensors(folder / f)


def check_safetensors(path: Path) -> None:
    """UserError when `path` is not a whole safetensors file: its 8-byte header length, the JSON
    header, and the end of the last tensor's data must equal the file's size."""
    size = path.stat().st_size
    problem = None
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            problem = f"{size} bytes, shorter than a safetensors header"
        else:
            n = struct.unpack("<Q", head)[0]
            if 8 + n > size:
                problem = f"its header needs {8 + n} bytes, the file has {size}"
            else:
                try:
                    header = json.loads(f.read(n))
                except ValueError:
                    problem = "its header is not JSON"
                else:
                    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
                    if 8 + n + end != size:
                        problem = f"its tensors end at byte {8 + n + end}, the file has {size}"
    if problem:
        raise UserError(f"{path} is truncated or damaged ({problem}): copy it again, or load an earlier checkpoint")
