"""Mesh: this rank's groups of a Layout, two layouts side by side on the same ranks."""
from __future__ import annotations

import pytest
import torch

from fivefold.runtime import comm
from fivefold.runtime.mesh import Mesh
from fivefold.topology import Layout


def _two_meshes_case(rank, world):
    actor = Mesh.build(Layout(tp=2, dp=2))
    ref = Mesh.build(Layout(dp=4))
    again = Mesh.build(Layout(tp=2, dp=2))
    # Megatron order tp-cp-ep-dp-pp: tp groups {0,1},{2,3}; dp groups {0,2},{1,3}.
    assert actor.tp.ranks == ((0, 1) if rank < 2 else (2, 3))
    assert actor.dp.ranks == ((0, 2) if rank % 2 == 0 else (1, 3))
    assert actor.dp_cp.ranks == actor.dp.ranks and actor.pp.size == 1 and actor.pp.pg is None
    assert actor.tp.rank == rank % 2 and actor.dp.rank == rank // 2
    assert actor.coords == {"tp": rank % 2, "cp": 0, "dp": rank // 2, "pp": 0}
    assert ref.dp.ranks == (0, 1, 2, 3) and ref.tp.size == 1 and ref.tp.pg is None
    assert again.tp.pg is actor.tp.pg  # process groups cached by rank tuple
    results = {}
    for name, mesh, group in (("actor.tp", actor, actor.tp), ("actor.dp", actor, actor.dp),
                              ("ref.dp", ref, ref.dp), ("ref.tp", ref, ref.tp)):
        t = torch.tensor([2.0 ** rank])
        comm.all_reduce_(t, group, "test")
        results[name] = t.item()
        assert t.item() == sum(2.0 ** q for q in group.ranks), name
    return results


def test_two_layouts_coexist(workers):
    out = workers(4).run(_two_meshes_case)
    assert [r["actor.tp"] for r in out] == [3, 3, 12, 12]
    assert [r["actor.dp"] for r in out] == [5, 10, 5, 10]
    assert [r["ref.dp"] for r in out] == [15] * 4
    assert [r["ref.tp"] for r in out] == [1, 2, 4, 8]


def _pipeline_mesh_case(rank, world):
    mesh = Mesh.build(Layout(tp=2, pp=2))
    return mesh.pp.ranks, mesh.embedding.ranks, mesh.group("model-parallel").ranks, mesh.world.ranks


def test_pipeline_groups(workers):
    out = workers(4).run(_pipeline_mesh_case)
    # pp strides over tp: stages {0,2} and {1,3}; embedding = first and last stage of each pipeline
    assert [o[0] for o in out] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [o[1] for o in out] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert all(o[2] == (0, 1, 2, 3) and o[3] == (0, 1, 2, 3) for o in out)


def test_one_rank_mesh_without_process_group():
    mesh = Mesh.build(Layout())
    assert mesh.rank == 0 and mesh.device == torch.device("cpu")
    assert all(mesh.group(n).pg is None and mesh.group(n).size == 1 for n in ("tp", "dp", "world", "dp-cp"))
    with pytest.raises(KeyError, match="no group 'nope'"):
        mesh.group("nope")


def test_layout_must_match_world():
    with pytest.raises(ValueError, match="needs 2 ranks"):
        Mesh.build(Layout(dp=2))


def test_device_is_a_gpu_per_rank_or_the_cpu():
    """cluster.device: auto takes CUDA only where every rank on the node has a GPU of its own (NCCL
    refuses two ranks on one device), else the CPU with a note naming both counts; cuda refuses a node
    with fewer GPUs than ranks, naming the fix; cpu is the CPU whatever the node has."""
    from fivefold.errors import UserError
    from fivefold.runtime.mesh import resolve_device
    assert resolve_device("auto", 4, gpus=0) == ("cpu", None)
    assert resolve_device("auto", 4, gpus=8) == ("cuda", None)
    kind, note = resolve_device("auto", 4, gpus=1)
    assert kind == "cpu" and "4 ranks on this node but 1 CUDA device" in note and "cluster.device: cuda" in note
    assert resolve_device("cpu", 1, gpus=8) == ("cpu", None)
    assert resolve_device("cuda", 8, gpus=8) == ("cuda", None)
    with pytest.raises(UserError, match="4 ranks on this node but 2 CUDA devices.*at most 2 ranks per node"):
        resolve_device("cuda", 4, gpus=2)
    with pytest.raises(UserError, match="sees no CUDA device.*cluster.device: cpu"):
        resolve_device("cuda", 1, gpus=0)


def test_a_mesh_without_a_device_takes_the_gpu_only_where_its_group_can_move_tensors_there(monkeypatch):
    """Mesh.build's default device on a machine with a GPU: gloo ranks (a test's workers) keep the CPU
    (gloo's send of a CUDA tensor failed on an H100); NCCL ranks and a one-process run take the GPU."""
    from fivefold.runtime import mesh as mesh_mod
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    seen = {}
    for backend, initialized, want in (("gloo", True, "cpu"), ("cuda:nccl,cpu:gloo", True, "cuda"),
                                       ("nccl", True, "cuda"), (None, False, "cuda")):
        monkeypatch.setattr(mesh_mod.dist, "is_initialized", lambda i=initialized: i)
        monkeypatch.setattr(mesh_mod.dist, "get_backend", lambda b=backend: b)
        seen[backend] = mesh_mod.default_device().type
        assert seen[backend] == want, seen


def test_train_refuses_a_device_it_cannot_give_every_rank(tmp_path, capsys, monkeypatch):
    """`train` settles the device before any rank starts: cuda on a node with too few GPUs, or a device
    name it does not know, is one message and exit 2, and no rank's log exists."""
    from pathlib import Path

    from fivefold.cli import main
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    demo = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"
    for device, says in (("cuda", "cluster.device=cuda: 4 ranks on this node but 1 CUDA device"),
                         ("tpu", "cluster.device='tpu': must be one of auto, cuda, cpu")):
        out = tmp_path / device
        assert main(["train", str(demo), f"cluster.device={device}", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, err
        assert not list(out.glob("logs/rank-*"))
