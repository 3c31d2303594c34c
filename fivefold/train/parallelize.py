"""`parallelize(model, mesh, config)`: every parallel dimension applied to a built model, in one place
and one order (torchtitan's `parallelize_llama`):

  1. TP / SP   the layers were built tensor-parallel from `mesh.tp` (fivefold.parallel.tensor.layers: each
               parameter created with its ParamMeta shard); checked here against the mesh and config;
  2. CP        attention over the sequence split across `mesh.cp` (ring / all-to-all);
  3. EP        the MoE layers hold this EP rank's experts (ETP slices), built from the mesh's EP/ETP
               groups and marked expert (ParamMeta.domain); checked here;
  4. recompute activation recompute per Decoder (Megatron's granularity / method / num_layers);
     compile   with training.compile, torch.compile of each decoder layer (in place: parameter
               names unchanged; collectives and the CP ring run between the compiled graphs);
  5. precision the parameters cast to the run's parameter dtype (bf16/fp16; fp32 main copies live in
               the optimizer: fivefold.config.precision);
  6. DP        the data-parallel mode (fivefold.parallel.data.data_parallel: replicate or ZeRO-1), over
               the gradient domains of the parameters' metadata: dense over DP x CP, experts over EDP.

The result, `Parts`, is what a training step runs (fivefold.train.step.train_step): the model (with
PP, the StageStack of this rank's stages), the pipeline (or None), the DataParallel and the mesh.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fivefold.config.schema import Config
from fivefold.model.decoder import Decoder
from fivefold.model.moe import MoE
from fivefold.model.recompute import Recompute
from fivefold.parallel.context.context_parallel import context_parallel_of
from fivefold.parallel.data.reducer import GradReducer
from fivefold.parallel.data.data_parallel import DataParallel
from fivefold.config.precision import Precision
from fivefold.parallel.tensor.layers import TPMode
from fivefold.pipeline.stages import PipelineModel


@dataclass
class Parts:
    """What a rank trains."""

    model: nn.Module
    """The Decoder, or with PP the StageStack of this rank's stages (parameters under global names)."""
    pipe: PipelineModel | None
    """With PP: the stages, schedule and executor; None without."""
    dp: DataParallel | None
    """Gradient reduction, clipping and the optimizer (it stands where a torch optimizer would); None
    for a frozen model (`parallelize(..., frozen=True)`), which only runs forward."""
    mesh: object

    @property
    def decoders(self) -> list[Decoder]:
        return list(self.pipe.stages.values()) if self.pipe is not None else [self.model]


def check_tensor_parallel(model: Decoder, mesh, config: Config) -> None:
    """The model's TP layers were built for this mesh's TP group and the config's SP setting."""
    built = model.tp.ranks if model.tp is not None else None
    want = mesh.tp.ranks if mesh.tp.size > 1 else None
    mode = TPMode.of(config.parallel.sequence_parallel and want is not None)
    if built != want or model.mode is not mode:
        raise ValueError(f"parallelize: the model was built for TP ranks {built} ({model.mode.value}); the mesh "
                         f"and config say {want} ({mode.value}): build it with build_decoder(config, mesh)")


def apply_context_parallel(model: Decoder, mesh) -> None:
    """Context parallelism: the model's ids become this CP rank's s/cp tokens and every attention
    layer attends over the whole sequence across `mesh.cp` (a no-op without CP)."""
    cp = context_parallel_of(mesh, model.cfg.num_attention_heads // (model.tp.size if model.tp else 1))
    model.cp = cp
    for module in model.modules():
        if hasattr(module, "context_parallel"):
            module.context_parallel = cp


def check_expert_parallel(model: Decoder, mesh) -> None:
    """Every MoE layer holds this mesh's EP rank's experts, split over its ETP group."""
    for m in model.modules():
        if isinstance(m, MoE):
            for built, want in ((m.groups.ep, mesh.ep), (m.groups.etp, mesh.etp)):
                if (built.ranks if built is not None else (mesh.rank,)) != want.ranks:
                    raise ValueError(f"parallelize: a MoE layer was built for EP/ETP groups {m.groups}, the mesh "
                                     f"has {want}: build it with build_decoder(config, mesh)")


def compile_layers(model: Decoder) -> None:
    """torch.compile every decoder layer in place (nn.Module.compile: the module and its parameter
    names stay; layers of one shape share the compiled code)."""
    for layer in model.layers.values():
        layer.compile()


def parallelize(model: Decoder | PipelineModel, mesh, config: Config, *,
                reducer_cls: type[GradReducer] = GradReducer, frozen: bool = False) -> Parts:
    """Apply TP/SP -> CP -> EP -> recompute -> compile -> precision -> DP to `model` (a Decoder from build_decoder, or a
    PipelineModel from build_pipeline) on this rank of `mesh`, as `config` says; see the module
    docstring. `reducer_cls`: the gradient reducer (tests substitute a recording one). `frozen`: a model
    that only runs forward (an RL reference, a reward model): no data-parallel mode (no gradient
    buffers, main parameters or optimizer state; its weights whole on every DP rank, whatever the
    config's ZeRO mode) and no parameter requiring a gradient."""
    pipe = model if isinstance(model, PipelineModel) else None
    module = pipe.module if pipe is not None else model
    decoders = list(pipe.stages.values()) if pipe is not None else [model]
    recompute = Recompute.from_training(config.training)
    for decoder in decoders:
        check_tensor_parallel(decoder, mesh, config)
        apply_context_parallel(decoder, mesh)
        check_expert_parallel(decoder, mesh)
        decoder.set_recompute(recompute)
        if config.training.compile:
            compile_layers(decoder)
    dtype = Precision.of(config.training).param_dtype
    module.to(dtype)  # in place: the Parameter objects (and their metadata) stay; the pipeline's executors
    # send activations in this dtype (fivefold.pipeline.stages.build_pipeline)
    if frozen:
        module.requires_grad_(False)
        return Parts(module, pipe, None, mesh)
    dp = DataParallel(module, mesh, config.training, moe=config.model.is_moe, reducer_cls=reducer_cls,
                      not_counted=pipe.uncounted_parameters() if pipe is not None else (), pipelined=pipe is not None,
                      expert_layers=[m for m in module.modules() if isinstance(m, MoE)])
    return Parts(module, pipe, dp, mesh)
