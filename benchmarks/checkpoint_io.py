"""Checkpoint save and load, ours vs torch.distributed.checkpoint (DCP), same model, same layout.

    python benchmarks/checkpoint_io.py               # DP=2, a ~29M-parameter Llama-style model
    python benchmarks/checkpoint_io.py --dp 4 --repeats 5

Each rank holds the model (fp32) and its AdamW state after one step (DP replicas: the same values).
Ours: `fivefold.checkpoint.io.save_checkpoint` / `load_checkpoint` (DP rank 0 writes parameters and
moments; every rank reads only its ranges back) and the async saver's blocking part (the copy to CPU;
the write then runs in a background thread, timed to its commit); and the same save and load with the
checksums off (a save that records none, so the load verifies none: what CRC-32 costs). DCP: `dcp.save` / `dcp.load` of the
same tensors as a flat state dict (parameters, exp_avg, exp_avg_sq), on gloo; DCP deduplicates the
replicated tensors so that one rank writes each. Per operation, the slowest rank's median over
`--repeats` runs, and the largest per-rank rise of resident memory during it (VmHWM after resetting
it with /proc/self/clear_refs; memory-mapped file pages count). One intra-op thread per rank.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivefold.config.schema import ModelConfig  # noqa: E402

MiB = 2**20
MODEL = ModelConfig(num_layers=8, hidden_size=512, num_attention_heads=8, vocab_size=8192)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _measure(fn) -> tuple[float, float]:
    """(seconds, MiB of resident memory above the start) of fn()."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = _rss_kib("VmRSS")
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    return dt, (_rss_kib("VmHWM") - before) / 1024


def _rank(rank: int, world: int, folder: str, repeats: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from fivefold.checkpoint import io
    from fivefold.checkpoint.async_save import AsyncSaver
    from fivefold.model import Decoder
    from fivefold.runtime import comm
    from fivefold.runtime.mesh import Mesh
    from fivefold.topology import Layout

    torch.manual_seed(0)
    mesh = Mesh.build(Layout(dp=world))
    model = Decoder(MODEL, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    barrier = lambda: comm.barrier(mesh.world)  # noqa: E731
    root = Path(folder)

    def ours_save(i):
        io.save_checkpoint(root / "ours", i, model=model, optimizer=opt, rank=rank, writes_params=mesh.dp.rank == 0,
                           barrier=barrier, extra={"optimizer_step": 1, "world_size": world}, keep=1)

    def ours_load(i):
        io.load_checkpoint(root / "ours", model=model, optimizer=opt, rank=rank, world_size=world)

    saver = AsyncSaver(rank, barrier)

    def unsummed(fn):
        """fn with the checksums off (fivefold.checkpoint.checksum): what they cost is the difference."""
        def run(i):
            kept = io.sums_of_written, io.write_sums
            io.sums_of_written, io.write_sums = (lambda path, held: None), (lambda path, sums: None)
            try:
                fn(i)
            finally:
                io.sums_of_written, io.write_sums = kept
        return run

    def plain_save(i):
        io.save_checkpoint(root / "plain", i, model=model, optimizer=opt, rank=rank, writes_params=mesh.dp.rank == 0,
                           barrier=barrier, extra={"optimizer_step": 1, "world_size": world}, keep=1)

    def plain_load(i):
        io.load_checkpoint(root / "plain", model=model, optimizer=opt, rank=rank, world_size=world)

    def ours_async_start(i):
        saver.save(root / "async", i, extra={"optimizer_step": 1, "world_size": world}, keep=1, model=model,
                   optimizer=opt, writes_params=mesh.dp.rank == 0)

    def flat_state():
        names = {id(p): n for n, p in model.named_parameters()}
        state = {n: p.data for n, p in model.named_parameters()}
        for p, s in opt.state.items():
            state[names[id(p)] + ".exp_avg"] = s["exp_avg"]
            state[names[id(p)] + ".exp_avg_sq"] = s["exp_avg_sq"]
        return state

    def dcp_save(i):
        dcp.save(flat_state(), checkpoint_id=str(root / "dcp" / f"step_{i}"))

    def dcp_load(i):
        dcp.load(flat_state(), checkpoint_id=str(root / "dcp" / f"step_{i}"))

    out = {}
    ops = [("ours", "save", ours_save), ("ours", "load", ours_load), ("ours", "async save (blocking part)", ours_async_start),
           ("ours, no checksums", "save", unsummed(plain_save)), ("ours, no checksums", "load", plain_load),
           ("DCP", "save", dcp_save), ("DCP", "load", dcp_load)]
    for who, what, fn in ops:
        times, mems = [], []
        for i in range(1, repeats + 1):
            dist.barrier()
            dt, mem = _measure(lambda: fn(i if what != "load" else repeats))
            times.append(dt)
            mems.append(mem)
            if what.startswith("async"):
                dt_commit = time.perf_counter()
                saver.finish()
                out.setdefault((who, "async save (write + commit, in background)"), []).append(
                    time.perf_counter() - dt_commit + dt)
        out[who, what] = (statistics.median(times), max(mems))
    commit = out.pop(("ours", "async save (write + commit, in background)"))
    out["ours", "async save (to commit)"] = (statistics.median(commit), 0.0)
    out["bytes"] = sum(p.numel() for p in model.parameters())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    from fivefold.testing.harness import Workers

    pool = Workers(args.dp, timeout=900)
    try:
        with tempfile.TemporaryDirectory() as folder:
            results = pool.run(_rank, folder, args.repeats)
    finally:
        pool.close()
    n = results[0].pop("bytes")
    for r in results[1:]:
        r.pop("bytes")
    print(f"DP={args.dp}, {MODEL.num_layers} layers, hidden {MODEL.hidden_size}, vocab {MODEL.vocab_size} "
          f"({n / 1e6:.1f}M parameters; fp32 weights + AdamW moments = {12 * n / MiB:.0f} MiB); gloo on CPU, "
          f"median of {args.repeats}\n")
    print("| runtime | operation | s (slowest rank) | peak RSS rise MiB (largest rank) |")
    print("|---|---|---|---|")
    for key in results[0]:
        who, what = key
        t = max(r[key][0] for r in results)
        m = max(r[key][1] for r in results)
        print(f"| {who} | {what} | {t:.3f} | {m:.0f} |" if m else f"| {who} | {what} | {t:.3f} | - |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
