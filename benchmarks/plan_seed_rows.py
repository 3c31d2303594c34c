"""Every row of the seeds' dense and MoE tables (and their worked examples) through `fivefold plan
--explain`: the seed's layout beside the top choice, or which rule it breaks / how many GiB it misses.

    python benchmarks/plan_seed_rows.py        # Markdown table for benchmarks/RESULTS.md

A row that gives a GPU range is run at one GPU count in it (named in the table). The dense table's
<1B and 10-70B rows have no preset model: a Llama-shaped 0.5B and 34B config.json (written to a
temporary folder) stand in for them.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivefold.cli import main  # noqa: E402

LLAMA_0_5B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 1024, "num_hidden_layers": 24,
              "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 4096, "vocab_size": 32000,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False}
LLAMA_34B = {**LLAMA_0_5B, "hidden_size": 8192, "num_hidden_layers": 48, "num_attention_heads": 64,
             "num_key_value_heads": 8, "intermediate_size": 22016}

# (seed row, MODEL, GPUs, global batch)
ROWS = [
    ("<1B, 1-8 GPUs: DP only", "llama-0.5b", 8, 256),
    ("1-10B, 8-16 GPUs: TP=2-4 + DP", "llama3-8b", 16, 256),
    ("10-70B, 16-64 GPUs: TP=4-8 + PP=2-4 + DP", "llama-34b", 64, 512),
    ("70-175B, 64-256 GPUs: TP=8 + PP=4-8 + DP", "llama3-70b", 128, 512),
    ("175-500B, 256-1024 GPUs: TP=8 + PP=8-16 + CP=2 + DP", "llama3-405b", 512, 1024),
    ("OLMoE 7B/1B: TP1 PP1 EP8", "olmoe-1b-7b", 8, 256),
    ("Moonlight 16B/3B: TP2 PP1 EP8", "moonlight-16b-a3b", 16, 256),
    ("DeepSeek-V2 236B/21B: TP1 PP4 EP32", "deepseek-v2", 128, 1024),
    ("GLM-4.5 Air 106B/12B: TP1 PP4 EP8", "glm-4.5-air", 32, 512),
    ("Qwen3 30B-A3B: TP4 PP2 EP4", "qwen3-30b-a3b", 32, 512),
    ("GLM-4.5 355B/32B: TP2 PP8 EP16", "glm-4.5", 256, 1024),
    ("Qwen3 235B-A22B: TP4 PP16 EP8 (CP=2 for pretrain)", "qwen3-235b-a22b", 512, 1024),
    ("DeepSeek-V3 671B/37B: TP2 PP16 EP64", "deepseek-v3", 1024, 4096),
    ("Kimi-K2 1T: TP2 PP16 EP32", "kimi-k2", 1024, 4096),
    ("LLaMA 3 70B on 64 GPUs: TP4 PP4 DP4", "llama3-70b", 64, 128),
    ("LLaMA 3 405B on 256 GPUs: TP8 PP8 CP2 DP2", "llama3-405b", 256, 512),
    ("DeepSeek-V3 671B on 256 GPUs: TP2 PP16 EP64", "deepseek-v3", 256, 1024),
]


def explain_row(text: str, model: str, gpus: int, gbs: int) -> tuple[str, str, float]:
    """(the top choice's line, what --explain says about the seed row, seconds)."""
    out = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(["plan", "--model", model, "--gpus", str(gpus), "--global-batch", str(gbs), "--top", "1", "--explain"])
    lines = out.getvalue().splitlines()
    if rc != 0:
        return "-", f"exit {rc}: " + " ".join(lines[-3:]), time.perf_counter() - t0
    top = next((line.split(None, 1)[1] for line in lines if line.strip().startswith("1 ")), "?")
    said = next((lines[i + 1].strip() for i, line in enumerate(lines) if text in line and i + 1 < len(lines)),
                "(row not shown)")
    return " ".join(top.split()), said, time.perf_counter() - t0


def main_rows() -> int:
    missing = 0
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for name, cfg in (("llama-0.5b", LLAMA_0_5B), ("llama-34b", LLAMA_34B)):
            paths[name] = Path(tmp) / name / "config.json"
            paths[name].parent.mkdir()
            paths[name].write_text(json.dumps(cfg))
        print("| seed row | model, GPUs | top choice (step s, MFU, ...) | seed layout per --explain | s |")
        print("|---|---|---|---|---|")
        for text, model, gpus, gbs in ROWS:
            top, said, secs = explain_row(text, str(paths.get(model, model)), gpus, gbs)
            missing += said == "(row not shown)"
            print(f"| {text} | {model}, {gpus} | {top} | {said.lstrip('-> ')} | {secs:.1f} |", flush=True)
    return 1 if missing else 0


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # no options; -h says what it runs
    raise SystemExit(main_rows())
