"""`fivefold export CHECKPOINT OUT_DIR [--max-shard-size 5GB]`: a fivefold checkpoint (any layout) as a
Hugging Face `save_pretrained` folder (fivefold.hf.export)."""
from __future__ import annotations

import argparse
from pathlib import Path

from fivefold.cli._lock import holding, refuse_if_held
from fivefold.cli._outputs import output_folder

HELP = "write a checkpoint (any layout) as a Hugging Face folder: config.json + safetensors (+ index, tokenizer)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a step_* folder, or a checkpoints root (its latest)")
    p.add_argument("out_dir", help="the folder to write: new, empty, or an earlier export (replaced); "
                                   "a folder holding anything else is refused")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB, as transformers)")


def run(args, extra: list[str]) -> int:
    from fivefold.hf.export import export_hf

    target = Path(args.out_dir).resolve()
    lock = target.parent / f".{target.name}.fivefold.lock"  # beside OUT_DIR, which is replaced as a whole
    refuse_if_held("OUT_DIR", target, lock)
    output_folder("OUT_DIR's folder", target.parent)  # OUT_DIR is written beside, then moved
    with holding("OUT_DIR", target, "export", lock):
        out = export_hf(args.checkpoint, args.out_dir, max_shard_size=args.max_shard_size)
    print(f"wrote {out} (load with transformers: AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0
