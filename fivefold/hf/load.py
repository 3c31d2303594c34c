"""Import a local Hugging Face Llama / Mistral / Mixtral / Qwen2 / Qwen3 / Qwen3-MoE / OLMoE or DeepSeek-V3
checkpoint folder (config.json + safetensors) — no network.

    state_dict_from_hf(dir, cfg)   safetensors (single file or sharded index) -> our parameter names
    read_hf_shards(model, dir, cfg) each parameter's own rows / columns (TP / EP / PP shards), read as slices
    load_hf(dir, **kw)             -> Decoder(config_from_hf(dir), **kw) holding the checkpoint's weights

The config is read by fivefold.config.hf, the names mapped by fivefold.hf.names. Only safetensors are read:
pickled `pytorch_model.bin` files can run code when loaded.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from fivefold.checkpoint.io import placed_by_meta, tensors_saved
from fivefold.config.hf import INDEX, config_from_hf, hf_folder, unread_note, weight_files
from fivefold.config.schema import ModelConfig
from fivefold.errors import UserError
from fivefold.hf.names import checkmtp_copies, hf_name
from fivefold.model.block import DecoderLayer
from fivefold.model.decoder import Decoder
from fivefold.model.init import VOCAB_PARAMS
from fivefold.model.mtp import MTPLayer
from fivefold.parallel.tensor.layers import TPMode, shard_state_dict


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our full parameter (and saved buffer: the expert bias) names -> the shape HF stores (vocabulary
    unpadded)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    shapes = {"embedding.weight": (v, h)}
    for i in range(cfg.num_layers):
        with torch.device("meta"):
            layer = DecoderLayer(cfg, layer=i)  # dense or MoE (first_k_dense)
        shapes.update({f"layers.{i}.{n}": tuple(p.shape) for n, p in tensors_saved(layer).items()})
    shapes.update({"final_norm.weight": (h,), "head.weight": (v, h)})
    for k in range(cfg.mtp_num_layers or 0):
        with torch.device("meta"):
            module = MTPLayer(cfg, None, TPMode.ALL_REDUCE, depth=k + 1)
        shapes.update({f"mtp.{k}.{n}": tuple(p.shape) for n, p in tensors_saved(module).items()})
    return shapes


def state_dict_from_hf(path: str | Path, cfg: ModelConfig, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Our name -> fp32 tensor for `names` (default: the whole model), vocabulary matrices zero-padded
    to cfg.padded_vocab_size(). Reads only the tensors asked for, file by file."""
    d = hf_folder(path)
    shapes = expected_shapes(cfg)
    wanted = list(shapes) if names is None else list(names)
    files = weight_files(d)
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in wanted:
        theirs = hf_name(name, cfg)
        if theirs not in files:
            raise UserError(f"{d}: no tensor {theirs!r} in the checkpoint (needed for our {name}); "
                            "do config.json and the weights belong together?")
        by_file[files[theirs]].append(name)
    out = _read(by_file, shapes, cfg)
    for name in ("embedding.weight", "head.weight"):
        if name in out:
            checkmtp_copies(name, out[name][: cfg.vocab_size], cfg, lambda copy: _part(files, copy, slice(None)))
    return out


def _part(files: dict[str, Path], theirs: str, index) -> torch.Tensor | None:
    """Tensor `theirs` indexed by `index` (a slice or tuple of slices), read alone; None if not stored."""
    if theirs not in files:
        return None
    with safe_open(str(files[theirs]), framework="pt") as f:
        return f.get_slice(theirs)[index]


def _read(by_file: dict[Path, list[str]], shapes: dict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        if not file.is_file():
            raise UserError(f"{file.parent / INDEX}: lists {file.name}, which is missing")
        try:
            with safe_open(str(file), framework="pt") as f:
                present = set(f.keys())
                for name in names:
                    if hf_name(name, cfg) not in present:
                        raise UserError(f"{file}: has no tensor {hf_name(name, cfg)!r}, which the index puts there")
                    t = f.get_tensor(hf_name(name, cfg)).float()
                    if tuple(t.shape) != shapes[name]:
                        raise UserError(f"{file}: {hf_name(name, cfg)} has shape {list(t.shape)}, "
                                        f"config.json implies {list(shapes[name])}")
                    if name in VOCAB_PARAMS:
                        pad = cfg.padded_vocab_size() - t.shape[0]
                        t = torch.cat([t, t.new_zeros(pad, t.shape[1])])  # padded rows are zero
                    out[name] = t
        except UserError:
            raise
        except Exception as e:  # a damaged file: safetensors' own error types
            raise UserError(f"{file}: not a readable safetensors file ({e})") from e
    return out


def read_hf_shards(model: torch.nn.Module, path: str | Path, cfg: ModelConfig) -> None:
    """Fill every parameter of `model` (this rank's TP / EP / PP share of it, placed by its
    ParamMeta) and its saved buffers (the expert bias, whole) from the HF folder, reading only the
    rows and columns it holds (safetensors slices); padded vocabulary rows zero."""
    d = hf_folder(path)
    files = weight_files(d)
    shard_of = placed_by_meta(model)
    shapes = expected_shapes(cfg)
    with torch.no_grad():
        for name, p in tensors_saved(model).items():
            theirs = hf_name(name, cfg)
            if theirs not in files:
                raise UserError(f"{d}: no tensor {theirs!r} (needed for our {name}); do config.json and the "
                                "weights belong together?")
            spec = shard_of(name, p)
            full = shapes[name]
            rows = [(o, min(o + n, g)) for o, n, g in zip(spec.offsets, p.shape, full)]  # padding is past g
            try:
                with safe_open(str(files[theirs]), framework="pt") as f:
                    if list(f.get_slice(theirs).get_shape()) != list(full):
                        raise UserError(f"{files[theirs]}: {theirs} has shape {f.get_slice(theirs).get_shape()}, "
                                        f"config.json implies {list(full)}")
                    part = f.get_slice(theirs)[tuple(slice(a, b) for a, b in rows)]
            except UserError:
                raise
            except Exception as e:  # a damaged file: safetensors' own error types
                raise UserError(f"{files[theirs]}: not a readable safetensors file ({e})") from e
            index = tuple(slice(a, b) for a, b in rows)
            checkmtp_copies(name, part, cfg, lambda copy: _part(files, copy, index))
            p.zero_()
            p[tuple(slice(0, b - a) for a, b in rows)].copy_(part)


def load_hf(path: str | Path, **kw) -> Decoder:
    """Decoder(config_from_hf(path), **kw) with the checkpoint's weights (only the tensors the given
    layers / embedding / head need are read)."""
    cfg = config_from_hf(path)
    note = unread_note(path, cfg)
    if note:
        print(f"note: {note}")
    model = Decoder(cfg, **kw)
    state = state_dict_from_hf(path, cfg, names=model.state_dict().keys())
    model.load_state_dict(shard_state_dict(model, state))  # tensor-parallel: this rank's slices
    return model
