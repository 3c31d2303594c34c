"""Export a fivefold checkpoint (any layout) as a Hugging Face `save_pretrained` folder.

    export_hf(checkpoint, out_dir)   config.json, generation_config.json, model.safetensors (or
                                     model-0000k-of-0000n.safetensors + model.safetensors.index.json),
                                     and the run's tokenizer files when it used a Hugging Face tokenizer

Each parameter is assembled whole from the checkpoint's shards (every TP / PP / EP / ZeRO layout wrote
its slices at their offsets in the one-process tensor; `fivefold.checkpoint.io`), its padded vocabulary
rows dropped, renamed by `fivefold.hf.names.hf_name` (the importer's map, so import -> export gives the
same tensors, bit for bit) and written in the checkpoint's dtype, one tensor at a time: memory holds one
output shard (at most `max_shard_bytes`) and one parameter. A tied output layer is not written (HF ties
it to `model.embed_tokens.weight`).

Families: Llama (RMSNorm, SwiGLU, RoPE, no biases), Qwen2 (QKV biases), Qwen3 (q / k norms), Mixtral (its MoE layers: softmax router, top-k
renormalised, no shared expert, every layer MoE), Qwen3-MoE (Qwen3's q / k norms with Mixtral-like MoE
layers, top-k renormalised or not: norm_topk_prob), OLMoE (Qwen3-MoE's layers with q / k norms over the
whole projection: qk_layernorm_scope "projection") and DeepSeek-V3 (MLA; MoE layers with its router:
sigmoid, the expert bias written as e_score_correction_bias in fp32, groups, routed scaling, shared
experts, first layers dense; its multi-token prediction layers as layers num_hidden_layers + k - 1, with
the copies of the embedding and output layer DeepSeek-V3 stores in each) — the ones `load_hf` imports. Anything else is refused
naming what HF's config could not say.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fivefold.checkpoint.io import Held, assemble, check_fits, read_metadata
from fivefold.checkpoint.layout import ShardSpec, source_name
from fivefold.checkpoint.metadata import damaged
from fivefold.config.schema import ModelConfig, config_from_dict
from fivefold.errors import UserError, write_failed
from fivefold.config.hf import INDEX, SINGLE
from fivefold.hf.config import hf_config
from fivefold.hf.load import expected_shapes
from fivefold.hf.names import hf_name, mtp_copies
from fivefold.model.init import VOCAB_PARAMS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt")
DTYPES = {"torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16}


def _whole(folder: Path, meta: dict, name: str, cfg: ModelConfig, shape: tuple[int, ...]) -> torch.Tensor:
    """Parameter `name` of the one-process model, assembled from the checkpoint's shards, unpadded."""
    src = source_name(name, meta["params"])
    entry = meta["params"].get(src)
    if entry is None:
        raise UserError(f"checkpoint {folder}: no parameter {name} (was it saved by this model?)")
    padded = tuple(entry["global_shape"])
    out = torch.empty(padded, dtype=DTYPES.get(entry["dtype"], torch.float32))
    if not assemble(folder, meta, entry, src, out, ShardSpec(padded, (0,) * len(padded))):
        raise UserError(f"checkpoint {folder}: its shards do not cover parameter {name} (a rank's files missing?)")
    return out[: shape[0]].contiguous() if name in VOCAB_PARAMS else out


def _size_bytes(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = text.strip().upper()
    for u in sorted(units, key=len, reverse=True):
        if t.endswith(u):
            try:
                size = float(t[: -len(u)])
            except ValueError:
                break
            if size >= 0 and math.isfinite(size):  # (0: a file per tensor, as transformers)
                return int(size * units[u])
            break
    if t.isdigit():
        return int(t)
    raise UserError(f"--max-shard-size {text!r}: give a size such as 5GB, 500MB or 2GiB")


def export_hf(checkpoint: str | Path, out_dir: str | Path, *, max_shard_size: str = "5GB") -> Path:
    """Write `checkpoint` (a step folder or a root with `latest`) as a save_pretrained folder, replacing
    an earlier export there (`check_replaceable`). The files are written into a new hidden folder
    beside OUT_DIR (`_new_folder`: never a name a user's folder has) and renamed into place once
    complete; an error or Ctrl-C removes it, and leaves OUT_DIR as it was."""
    out = check_replaceable(Path(out_dir))
    folder, meta = read_metadata(checkpoint, "CHECKPOINT")
    if "config" not in meta:
        raise UserError(f"checkpoint {folder}: its metadata has no config (not written by fivefold train)")
    try:
        config = config_from_dict(meta["config"])
    except TypeError as e:  # a key no section has (read_metadata checks the model section's)
        raise damaged(folder / "metadata.json", f"its config does not load ({e})") from None
    cfg = config.model
    shapes = expected_shapes(cfg)
    names = [n for n in shapes if not (n == "head.weight" and cfg.tie_word_embeddings)]
    first = meta["params"].get(source_name(names[0], meta["params"]), {})
    dtype = DTYPES.get(first.get("dtype"), torch.float32)
    hf = hf_config(cfg, dtype)  # first: what HF cannot say (its shapes are not all `expected_shapes`)
    # the same check as --load and convert: a config that does not describe the tensors is refused,
    # never exported as a folder transformers cannot load (or loads wrong)
    check_fits(meta, {n: Held(s, cfg.vocab_size if n in VOCAB_PARAMS else None) for n, s in shapes.items()},
               None, folder, fix="its metadata.json's config does not describe its tensors: the checkpoint is "
               "damaged (export the one before it)")
    limit = _size_bytes(max_shard_size)
    tmp = _new_folder(out, "export")
    try:
        _write_export(folder, meta, config, names, shapes, hf, limit, tmp)
        _replace(out, tmp)
    except OSError as e:  # a full disk, a read-only folder: named, OUT_DIR as it was
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failed(e.filename or tmp, e, f"the export; {out} is left as it was") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_export(folder: Path, meta: dict, config, names: list[str], shapes: dict, hf: dict, limit: int,
                  tmp: Path) -> None:
    cfg = config.model
    shards, current, size = [], {}, 0
    for name in names:
        t = _whole(folder, meta, name, cfg, shapes[name])
        copies = mtp_copies(cfg).get(name, [])  # DeepSeek-V3's MTP layers store their own (equal) copies
        if current and size + t.nbytes * (1 + len(copies)) > limit:
            shards.append(current)
            current, size = {}, 0
        current[hf_name(name, cfg)] = t
        current.update({copy: t.clone() for copy in copies})  # safetensors refuses tensors sharing storage
        size += t.nbytes * (1 + len(copies))
    shards.append(current)
    _write_shards(tmp, shards)
    (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps({"_from_model_config": True}, indent=2) + "\n")
    _copy_tokenizer(config.data.tokenizer, tmp)


def _new_folder(out: Path, what: str) -> Path:
    """A new, empty hidden folder beside `out`, named for what it holds (`.OUT.fivefold-export-3f9a1c`):
    made with mkdir, which fails rather than reuse a folder that exists, so no user's folder is ever
    written into or removed (as mkdtemp, but with the default permissions the final folder keeps)."""
    for _ in range(100):
        tmp = out.parent / f".{out.name}.fivefold-{what}-{os.urandom(3).hex()}"
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue
        except OSError as e:
            raise UserError(f"OUT_DIR {out}: cannot write beside it in {out.parent} ({e.strerror or e})") from None
    raise UserError(f"OUT_DIR {out}: cannot make a new folder in {out.parent}")


def _replace(out: Path, tmp: Path) -> None:
    """Move the complete `tmp` to `out`; an earlier export there (`check_replaceable`) is moved aside
    first and removed only once the new one is in place (a crash in between leaves it, hidden, beside)."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = _new_folder(out, "replaced")
    os.replace(out, old)  # (onto the empty folder just made: a rename of a folder over an empty one)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def check_replaceable(out: Path, flag: str = "OUT_DIR") -> Path:
    """`out`, resolved (`.` is the current folder), if it may be written: absent, empty, or an earlier
    export (`_an_export`), which the export replaces whole; a file, a folder holding anything else (a
    run, a checkpoint, a downloaded Hugging Face model, the user's files), the current folder or one
    above it, or a place that cannot be written is refused rather than deleted (`flag`: the option
    that named it; `fivefold train` checks checkpoint.save_hf before its ranks start)."""
    given, out = out, Path(out).resolve()
    cwd = Path.cwd().resolve()
    if out == cwd or out in cwd.parents:
        raise UserError(f"{flag} {given}: is the current folder{'' if out == cwd else ' or holds it'}, which the "
                        "export would replace whole; give a folder inside it, e.g. ./hf")
    if out.exists() and not out.is_dir():
        raise UserError(f"{flag} {given}: a file is there, not a folder (remove it, or give another path)")
    above = out.parent
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        raise UserError(f"{flag} {given}: {above} is a file, not a folder (give another path)")
    if not os.access(above, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {given}: {above} is not writable (give another path)")
    if not out.exists():
        return out
    names = {p.name for p in out.iterdir()}
    if names and not _an_export(out, names):
        shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
        raise UserError(f"{flag} {given}: holds {shown}, not an earlier export, and the export replaces the whole "
                        "folder; give a new or empty folder")
    return out


MARK = {"written_by": "fivefold export"}
"""In the weights' safetensors metadata (and the shard index's): the folder is an export, which a
later export may replace (`_an_export`); loaders read neither."""


def _an_export(folder: Path, names: set[str]) -> bool:
    """Whether `folder` (holding `names`) is what an export writes: only its files, and weights marked
    `MARK` (a Hugging Face model downloaded there has the same file names, not the mark)."""
    shards = {n for n in names if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", n)}
    if not names - shards <= {"config.json", "generation_config.json", SINGLE, INDEX, *TOKENIZER_FILES}:
        return False
    try:
        if SINGLE in names:
            with safe_open(str(folder / SINGLE), framework="pt") as f:
                meta = f.metadata() or {}
        else:
            meta = json.loads((folder / INDEX).read_text()).get("metadata", {})
    except (OSError, ValueError, AttributeError, SafetensorError):
        return False
    return isinstance(meta, dict) and all(meta.get(k) == v for k, v in MARK.items())


def _write_shards(folder: Path, shards: list[dict[str, torch.Tensor]]) -> None:
    if len(shards) == 1:
        save_file(shards[0], str(folder / SINGLE), metadata={"format": "pt", **MARK})
        return
    weight_map, total = {}, 0
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt", **MARK})
        weight_map.update({name: file for name in shard})
        total += sum(t.nbytes for t in shard.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total, **MARK}, "weight_map": weight_map},
                                           indent=2))


def _copy_tokenizer(tokenizer: str, folder: Path) -> None:
    """The run's Hugging Face tokenizer files (its data.tokenizer folder); nothing for the byte tokenizer."""
    src = Path(tokenizer)
    if tokenizer == "byte" or not src.is_dir():
        return
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, folder / name)
