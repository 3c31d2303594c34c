"""fivefold.checkpoint.reshard in one process: a destination shard is filled from pieces saved in
another sharding (whole blocks or ZeRO's flat ranges), or from a Hugging Face folder through a name
map with a fused tensor, reading only the elements it needs."""
from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from fivefold.checkpoint.layout import ShardSpec
from fivefold.checkpoint.reshard import Piece, Reader, Saved, fill, fill_flat, hf_source, load_params, specs_of
from fivefold.parallel.param_meta import ParamMeta, Shard


class CountingReader(Reader):
    """A Reader that counts the elements it reads from files."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def read(self, piece, slices):
        t = super().read(piece, slices)
        self.elements += t.numel()
        return t


def _full():
    return torch.arange(8 * 6, dtype=torch.float32).view(8, 6)


def test_tp4_pieces_fill_a_tp2_shard_reading_only_its_rows(tmp_path):
    full = _full()
    pieces = []
    for r in range(4):  # saved at TP4: rows 2r..2r+1, one file per rank
        save_file({"w": full[2 * r: 2 * r + 2].clone()}, str(tmp_path / f"m{r}.safetensors"))
        pieces.append(Piece(tmp_path / f"m{r}.safetensors", "w", (2 * r, 0), (2, 6)))
    saved = Saved((8, 6), "torch.float32", tuple(pieces))
    meta = ParamMeta(shard=Shard((8, 6), 0, 4, 4))  # TP2 rank 1: rows 4..7
    out = torch.zeros(4, 6)
    with CountingReader() as reader:
        assert fill(out, specs_of({"w": out}, {"w": meta})["w"], saved, reader)
        assert reader.elements == out.numel()  # only its own rows are read
    assert torch.equal(out, full[4:])
    col = torch.zeros(8, 3)  # a column shard (row-parallel layer) reads 3 of 6 columns of each piece
    with CountingReader() as reader:
        assert fill(col, ShardSpec((8, 6), (0, 3)), saved, reader)
        assert reader.elements == col.numel()
    assert torch.equal(col, full[:, 3:])


def test_flat_ranges_fill_another_flat_range_of_another_shard(tmp_path):
    full = _full()
    flat = full.reshape(-1)
    pieces = []
    for r, (lo, hi) in enumerate(((0, 20), (20, 48))):  # ZeRO-1 at DP2 of the whole tensor: uneven chunks
        save_file({"m": flat[lo:hi].clone()}, str(tmp_path / f"o{r}.safetensors"))
        pieces.append(Piece(tmp_path / f"o{r}.safetensors", "m", (0, 0), (8, 6), (lo, hi)))
    saved = Saved((8, 6), "torch.float32", tuple(pieces))
    spec = ShardSpec((8, 6), (0, 3))  # the destination: a column shard (8, 3), its flat elements 5..17
    with CountingReader() as reader:
        got = fill_flat((8, 3), spec, (5, 17), saved, reader)
        # the window of each saved range that can meet the shard: columns 3..5 of rows 0..7 span
        # flat 3..47, so 17 elements of the first range and all 28 of the second
        assert reader.elements == 17 + 28
    assert torch.equal(got, full[:, 3:].reshape(-1)[5:17])
    with CountingReader() as reader:  # a row shard (rows 4..7: flat 24..47) meets the second range only
        got = fill_flat((4, 6), ShardSpec((8, 6), (4, 0)), (0, 24), saved, reader)
        assert reader.elements == 24
    assert torch.equal(got, flat[24:])
    assert fill_flat((8, 3), spec, (0, 24), Saved((8, 6), "torch.float32", pieces[:1]), Reader()) is None


def test_hf_folder_with_an_index_and_a_fused_tensor(tmp_path):
    q, k, v = torch.randn(8, 4), torch.randn(2, 4), torch.randn(2, 4)
    save_file({"q": q, "k": k}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"v": v, "norm": torch.ones(4)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "q": "model-00001-of-00002.safetensors", "k": "model-00001-of-00002.safetensors",
        "v": "model-00002-of-00002.safetensors", "norm": "model-00002-of-00002.safetensors"}}))
    source = hf_source(tmp_path, {"qkv": [("q", 0), ("k", 8), ("v", 10)], "norm": "norm"})
    assert source["qkv"].global_shape == (12, 4)
    qkv, norm = torch.zeros(6, 4), torch.zeros(4)  # TP2 rank 1 of the fused rows: q[6:8], k, v
    metas = {"qkv": ParamMeta(shard=Shard((12, 4), 0, 6, 6))}
    load_params({"qkv": qkv, "norm": norm}, specs_of({"qkv": qkv, "norm": norm}, metas), source, "hf")
    assert torch.equal(qkv, torch.cat([q, k, v])[6:])
    assert torch.equal(norm, torch.ones(4))


def _boxes(full_shape, dim, cuts):
    """Blocks of a tensor of `full_shape` split along `dim` at `cuts`: [(offsets, shape)]."""
    edges = [0, *cuts, full_shape[dim]]
    out = []
    for a, b in zip(edges, edges[1:]):
        off = tuple(a if d == dim else 0 for d in range(len(full_shape)))
        shp = tuple(b - a if d == dim else n for d, n in enumerate(full_shape))
        out.append((off, shp))
    return out


def test_fill_flat_equals_slicing_the_full_tensor_for_random_layouts(tmp_path):
    """Saved: split along a random dim, each block whole or as two flat ranges (ZeRO); wanted: a
    random flat range of a block of another split. Both paths (one contiguous copy, and the
    element-wise window) against slicing the full tensor."""
    g = torch.Generator().manual_seed(0)
    full = torch.randn(6, 5, generator=g)
    for case in range(60):
        r = lambda n: int(torch.randint(n, (), generator=g))  # noqa: E731
        pieces = []
        for i, (off, shp) in enumerate(_boxes((6, 5), r(2), sorted({1 + r(4), 1 + r(4)}))):
            block = full[off[0]: off[0] + shp[0], off[1]: off[1] + shp[1]].contiguous()
            n = block.numel()
            if r(2):
                cut = r(n + 1)
                for j, (lo, hi) in enumerate(((0, cut), (cut, n))):
                    f = tmp_path / f"c{case}-{i}-{j}.safetensors"
                    save_file({"t": block.reshape(-1)[lo:hi].clone()}, str(f))
                    pieces.append(Piece(f, "t", off, shp, (lo, hi)))
            else:
                f = tmp_path / f"c{case}-{i}.safetensors"
                save_file({"t": block}, str(f))
                pieces.append(Piece(f, "t", off, shp))
        saved = Saved((6, 5), "torch.float32", tuple(pieces))
        off, shp = _boxes((6, 5), r(2), [2])[r(2)]
        n = shp[0] * shp[1]
        lo = r(n)
        hi = lo + 1 + r(n - lo)
        with Reader() as reader:
            got = fill_flat(shp, ShardSpec((6, 5), off), (lo, hi), saved, reader)
        want = full[off[0]: off[0] + shp[0], off[1]: off[1] + shp[1]].reshape(-1)[lo:hi]
        assert torch.equal(got, want), case


def test_a_bf16_checkpoint_loads_fp32_weights_from_its_main_copies(tmp_path):
    """A 16-bit run saves its fp32 main copies; an fp32 run loading it takes those, not the rounded
    bf16 weights (and a run without main copies to read takes the bf16 values)."""
    from torch import nn

    from fivefold.checkpoint import io
    from fivefold.parallel.optimizer import OptimShard

    torch.manual_seed(0)
    bf16 = nn.Linear(4, 3).to(torch.bfloat16)
    mains = {n: p.detach().float() + 1e-4 * torch.randn(p.shape) for n, p in bf16.named_parameters()}
    for m in mains.values():
        m.grad = torch.ones_like(m)
    opt = torch.optim.AdamW(list(mains.values()))
    opt.step()
    shards = [OptimShard(n, m, (0, m.numel())) for n, m in mains.items()]
    io.save_checkpoint(tmp_path, 1, model=bf16, optimizer=opt, rank=0, writes_params=True, barrier=lambda: None,
                       extra={"optimizer_step": 1, "world_size": 1}, optim_shards=shards)
    fp32 = nn.Linear(4, 3)
    io.load_checkpoint(tmp_path, model=fp32, optimizer=None, rank=0, world_size=1)
    for n, p in fp32.named_parameters():
        assert torch.equal(p, mains[n]), n
        assert not torch.equal(p, dict(bf16.named_parameters())[n].float())  # the rounding was real
