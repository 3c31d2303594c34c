"""What `fivefold plan --emit` prints is a config our own loader reads back to the same layout and model."""
import pytest

from fivefold.config.load import load_config
from fivefold.config.schema import to_dict
from fivefold.config.validate import validate
from fivefold.errors import UserError
from fivefold.planner.report.emit import emit
from fivefold.planner.presets import MODEL_PRESETS, hardware, model_preset
from fivefold.planner.search.ranking import search

SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
         "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
         "microbatch_group_size_per_vp_stage")
SUFFIX = {"fivefold": ".yaml", "rlinf": ".yaml", "megatron": ".txt", "torchrun": ".txt", "skyrl": ".txt"}


@pytest.fixture(scope="module")
def planned():
    """The five best layouts of an MoE model on 64 GPUs (EP, PP, VPP and TP all occur among them), the
    best interleaved one in microbatch groups (a global batch of 96: 3 microbatches of 4 on PP2), and
    and megatron-te's best Megatron-FSDP layout under PP for Llama 3 70B with ZeRO-2 in its space."""
    from fivefold.planner.calibration.runtime import profile
    r = search(model_preset("mixtral-8x7b").model, hardware("h100-sxm"), 64, 8, 4096, 1024)
    grouped = search(model_preset("llama3-8b").model, hardware("h100-sxm"), 64, 8, 4096, 96).ranked
    te = profile("megatron-te")
    fsdp = next(c.config for c in search(
        model_preset("llama3-70b").model, hardware("h100-sxm"), 64, 8, 4096, 256, space=te.space(
            dp_modes=("optim", "optim_grads")), mem=te.memory, ta=te.time, grad_reduce_in_bf16=True).ranked
        if c.config.training.use_megatron_fsdp and c.config.parallel.pipeline_model_parallel_size > 1)
    return [c.config for c in r.ranked[:5]] + [next(c.config for c in grouped if c.plan.group), fsdp]


@pytest.mark.parametrize("fmt", sorted(SUFFIX))
def test_emitted_config_reads_back_to_the_same_layout(fmt, planned, tmp_path):
    for i, cfg in enumerate(planned):
        path = tmp_path / f"plan{i}{SUFFIX[fmt]}"
        path.write_text(emit(cfg, fmt))
        loaded = load_config(str(path))  # the cluster comes from the text (SkyRL's placement keys once lacked)
        validate(loaded.config, loaded.dialect)  # raises on any broken rule
        back = loaded.config
        assert (back.cluster.resolved_world_size, back.cluster.gpus_per_node) == (64, 8), (fmt, path.read_text())
        for name in SIZES:
            assert getattr(back.parallel, name) == getattr(cfg.parallel, name), (fmt, name, path.read_text())
        assert back.training.micro_batch_size == cfg.training.micro_batch_size
        assert back.training.global_batch_size == cfg.training.global_batch_size
        assert back.training.sharding_strategy == cfg.training.sharding_strategy
        assert back.training.use_megatron_fsdp == cfg.training.use_megatron_fsdp, (fmt, path.read_text())


def _first_plan(name: str):
    """The best layout of preset `name` on the fewest of 64 / 256 / 512 H100s that fit it."""
    for gpus in (64, 256, 512):
        r = search(model_preset(name).model, hardware("h100-sxm"), gpus, 8, 4096, 1024)
        if r.ranked:
            return r.ranked[0].config, gpus
    raise AssertionError(f"{name}: no layout fits 512 GPUs")


@pytest.fixture(scope="module")
def every_preset():
    return {name: _first_plan(name) for name in MODEL_PRESETS}


@pytest.mark.parametrize("fmt", sorted(SUFFIX))
def test_every_preset_reads_back_to_the_same_model_layout_and_training(fmt, every_preset, tmp_path):
    """The whole model, parallel and training sections come back, not just the sizes: a Megatron-LM
    line that left out --swiglu / --normalization / --disable-bias-linear / --position-embedding-type /
    --group-query-attention would be read (as Megatron reads it) as another model."""
    for name, (cfg, gpus) in every_preset.items():
        path = tmp_path / f"{name}{SUFFIX[fmt]}"
        if fmt in ("megatron", "torchrun") and cfg.model.qk_layernorm_scope == "projection":
            with pytest.raises(UserError, match="qk_layernorm_scope='projection' has no Megatron-LM flag"):
                emit(cfg, fmt)  # OLMoE's projection-wide q / k norms: Megatron-LM would build another model
            continue
        path.write_text(emit(cfg, fmt))
        loaded = load_config(str(path))
        validate(loaded.config, loaded.dialect)
        assert loaded.config.cluster.resolved_world_size == gpus, (name, fmt)
        for section in ("model", "parallel", "training"):
            want, got = to_dict(getattr(cfg, section)), to_dict(getattr(loaded.config, section))
            assert got == want, (name, fmt, section, {k: (want[k], got[k]) for k in want if want[k] != got[k]})


def test_a_megatron_line_holds_only_megatron_lms_flags(planned):
    """`--emit megatron` is a `pretrain_gpt.py` line: every flag in it is Megatron-LM's (its pinned
    argument surface), none of fivefold's own (it wrote --pipeline-schedule interleaved, which
    Megatron's parser refuses: interleaving is what it runs with virtual stages); a schedule Megatron-LM
    does not have is refused, naming the formats that can say it. `--emit torchrun` keeps our flags."""
    import dataclasses

    from fivefold.config.megatron_surface import SURFACE
    lines = {i: emit(cfg, "megatron") for i, cfg in enumerate(planned)}
    assert any(cfg.parallel.pipeline_schedule == "interleaved" for cfg in planned)
    for i, text in lines.items():
        flags = [w for w in text.split("pretrain_gpt.py", 1)[1].split() if w.startswith("--")]
        assert flags and all(f in SURFACE for f in flags), (i, [f for f in flags if f not in SURFACE])
    interleaved = next(cfg for cfg in planned if cfg.parallel.pipeline_schedule == "interleaved")
    assert "--pipeline-schedule interleaved" in emit(interleaved, "torchrun")
    zero_bubble = dataclasses.replace(interleaved, parallel=dataclasses.replace(
        interleaved.parallel, pipeline_schedule="zb-h1", virtual_pipeline_model_parallel_size=None,
        microbatch_group_size_per_vp_stage=None))
    with pytest.raises(UserError, match=r"pipeline_schedule='zb-h1' has no Megatron-LM flag.*--emit torchrun"):
        emit(zero_bubble, "megatron")
    assert "--pipeline-schedule zb-h1" in emit(zero_bubble, "torchrun")


def test_fp8_plans_emit_megatrons_fp8_flags_and_mxfp8_needs_blackwell(capsys, tmp_path):
    """`plan --precision fp8 --fp8-recipe mxfp8` on GB200 emits --bf16 --fp8-format hybrid --fp8-recipe
    mxfp8, which reads back to the same precision and scaling; on an H100 the recipe is refused before
    the search (TransformerEngine runs MXFP8 on Blackwell only)."""
    from fivefold.cli import main
    words = ["plan", "--model", "llama3-8b", "--gpus", "8", "--precision", "fp8", "--fp8-recipe", "mxfp8",
             "--runtime", "megatron-te", "--top", "1"]
    assert main(words + ["--gpu", "gb200", "--emit", "megatron"]) == 0
    out = capsys.readouterr().out
    assert "--bf16" in out and "--fp8-format hybrid" in out and "--fp8-recipe mxfp8" in out
    path = tmp_path / "plan.txt"
    path.write_text(out[out.index("torchrun"):])  # the emitted command line
    t = load_config(str(path), world_size=8, gpus_per_node=8).config.training
    assert (t.precision, t.fp8_recipe) == ("fp8", "mxfp8")
    assert main(words + ["--gpu", "h100-sxm"]) == 2
    assert "mxfp8 runs on Blackwell tensor cores" in capsys.readouterr().err
    bf16 = [w for w in words if w not in ("--precision", "fp8")]  # a recipe without fp8 GEMMs: it was ignored
    assert main(bf16 + ["--gpu", "gb200"]) == 2
    assert "--fp8-recipe mxfp8: the scaling of fp8 GEMMs, and --precision is bf16" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", sorted(SUFFIX))
def test_fp8_plans_read_back_as_fp8_in_every_format(fmt, tmp_path):
    """An fp8 plan (fp8 GEMMs on bf16 parameters, tensorwise scaling) reads back as the same precision,
    format and recipe; RLinf's `precision: fp8` was refused ("not implemented yet"): its precision names
    the parameters' dtype, Megatron's `fp8` the GEMMs'."""
    from fivefold.planner.search.space import SearchSpace
    best = search(model_preset("llama3-8b").model, hardware("h100-sxm"), 8, 8, 4096, 64, "fp8",
                  SearchSpace(fp8_recipe="tensorwise")).ranked[0].config
    path = tmp_path / f"plan{SUFFIX[fmt]}"
    path.write_text(emit(best, fmt))
    loaded = load_config(str(path))
    validate(loaded.config, loaded.dialect)
    t = loaded.config.training
    assert (t.precision, t.fp8_format or "hybrid", t.fp8_recipe) == ("fp8", "hybrid", "tensorwise"), path.read_text()
