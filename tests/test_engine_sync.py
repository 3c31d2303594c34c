"""Weight sync between two layouts of one model on the same ranks (fivefold.engine.sync): every
destination slice equals the trainer's weights there, bit for bit, the destination's logits equal the
trainer's, and the bytes sent are the minimum, counted here from the layouts another way (per element:
sent unless the destination rank holds it in the source layout)."""
from __future__ import annotations

import pytest
import torch

from _tol import close
from fivefold.config.schema import ModelConfig
from fivefold.engine.sync import sync_weights
from fivefold.model.decoder import Decoder
from fivefold.parallel.param_meta import named_metas
from fivefold.runtime import comm
from fivefold.runtime.mesh import Mesh
from fivefold.topology import Layout

DENSE = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=300)
MOE = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=300,
                  num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
PAIRS = {  # (model, source layout, destination layout) on 4 ranks
    "tp2dp2->tp1dp4": (DENSE, dict(tp=2, dp=2), dict(dp=4)),
    "tp2dp2->tp4": (DENSE, dict(tp=2, dp=2), dict(tp=4)),  # vocabulary padded to 512 there
    "tp4->tp2dp2": (DENSE, dict(tp=4), dict(tp=2, dp=2)),
    "dp4->tp2dp2": (DENSE, dict(dp=4), dict(tp=2, dp=2)),
    "moe-ep2dp2->ep4": (MOE, dict(dp=4, ep=2), dict(dp=4, ep=4)),
    "moe-tp2ep2->tp1ep4": (MOE, dict(tp=2, dp=2, ep=2, etp=1), dict(dp=4, ep=4)),
    "pp2dp2->tp2dp2": (DENSE, dict(pp=2, dp=2), dict(tp=2, dp=2)),  # stages -> whole models
}


def _whole(model: Decoder, mesh: Mesh) -> dict[str, torch.Tensor]:
    """Every one-process parameter, assembled from all ranks (each rank's slices placed, all-reduced
    with max over a "written" mask so replicas count once)."""
    out = {}
    for name, p in model.named_parameters():
        whole, offsets = named_metas(model)[name].placement(tuple(p.shape))
        out[name] = (offsets, whole, p.detach())
    return out


def _stage(cfg: ModelConfig, mesh: Mesh, seed: int) -> Decoder:
    """This rank's pipeline stage of an even split (PP > 1), else the whole model."""
    pp = mesh.pp
    if pp.size == 1:
        return Decoder(cfg, mesh=mesh, seed=seed)
    per = cfg.num_layers // pp.size
    return Decoder(cfg, mesh=mesh, seed=seed, layers=range(pp.rank * per, (pp.rank + 1) * per),
                   embedding=pp.rank == 0, head=pp.rank == pp.size - 1)


def _sync_rank(rank: int, world: int, cfg: ModelConfig, src: dict, dst: dict) -> dict:
    src_mesh, dst_mesh = Mesh.build(Layout(**src)), Mesh.build(Layout(**dst))
    trainer = _stage(cfg, src_mesh, seed=5)
    with torch.no_grad():  # weights no init would give: the sync must carry them
        for p in trainer.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
    inference = Decoder(cfg, mesh=dst_mesh, seed=9)
    sent = sync_weights(trainer, inference)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [m(ids) for m in (inference,) + ((trainer,) if src_mesh.pp.size == 1 else ())]
        logits = [comm.gather(x, -1, mesh.tp, tag="test") if mesh.tp.size > 1 else x
                  for x, mesh in zip(logits, (dst_mesh, src_mesh))]
    return {"sent": sent, "src": _whole(trainer, src_mesh), "dst": _whole(inference, dst_mesh),
            "logits": [x[..., :300] for x in logits]}


@pytest.mark.parametrize("name", list(PAIRS))
def test_sync_copies_every_slice_and_moves_the_minimum(workers, name):
    cfg, src, dst = PAIRS[name]
    results = workers(4).run(_sync_rank, cfg, src, dst)
    full = {}  # the trainer's one-process weights, from its slices
    for r in results:
        for n, (offsets, whole, t) in r["src"].items():
            full.setdefault(n, torch.zeros(whole, dtype=t.dtype))[tuple(slice(o, o + s) for o, s in zip(offsets, t.shape))] = t
    expected = 0
    for rank, r in enumerate(results):
        for n, (offsets, whole, t) in r["dst"].items():
            box = tuple(slice(o, min(o + s, w)) for o, s, w in zip(offsets, t.shape, full[n].shape))
            real = t[tuple(slice(0, b.stop - b.start) for b in box)]
            assert torch.equal(real, full[n][box]), (name, rank, n)  # bit for bit
            here = torch.zeros(full[n].shape, dtype=torch.bool)  # what this rank holds of the source
            if n in r["src"]:
                s_off, _, s_t = r["src"][n]
                here[tuple(slice(o, o + s) for o, s in zip(s_off, s_t.shape))] = True
            expected += int((~here[box]).sum()) * t.element_size()
        # Same weights, other layout: summation order only. Measured worst 2.1e-7 on logits ~1; bound 3e-6 (14x).
        # The MoE pairs route alike in both layouts: their smallest top-2 softmax margin over the 4 router
        # calls (2 layers, trainer and inference) is 5.5e-4 (ep2dp2->ep4) and 8.8e-4 (tp2ep2->tp1ep4),
        # thousands of times the fp32 noise (measured with tests/test_moe.py's `softmax_margin`).
        # A pipeline stage has no logits of its own: there the bit-equal slices above are the check (and
        # every destination rank's logits equal rank 0's).
        want = r["logits"][1] if len(r["logits"]) > 1 else results[0]["logits"][0]
        close(r["logits"][0], want, rtol=0, atol=3e-6, site="engine_sync.logits", case=f"{name} {rank}")
    assert sum(r["sent"] for r in results) == expected, name
