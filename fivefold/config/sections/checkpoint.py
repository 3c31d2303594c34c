"""checkpoint: what is saved and loaded, and when (a section of fivefold.config.schema.Config)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class CheckpointConfig:
    save: str | None = None
    """Folder to save into; None = OUT/checkpoints. Default None."""
    load: str | None = None
    """Checkpoint folder to resume from. Default None."""
    save_interval: int | None = None
    """Steps between saves; None = only at the end. Default None."""
    async_save: bool = False
    """Write checkpoints from a background thread while training goes on (Megatron's --async-save;
    fivefold.checkpoint.async_save): committed at the next save or the end. Default False."""
    load_hf: str | None = None
    """A Hugging Face folder (config.json + safetensors) to start from, in any layout: weights only, a
    fresh optimizer at step 0 (Megatron's --finetune); the model section is read from its config.json.
    Default None."""
    save_hf: str | None = None
    """Also write the final model here as a Hugging Face folder (fivefold.hf.export). Default None."""
    exit_on_missing_checkpoint: bool = True
    """With `load`: a folder holding no checkpoint stops the run (UserError); False starts from step 0
    with a warning, as Megatron-LM does without --exit-on-missing-checkpoint (its scripts pass the save
    folder as --load to resume when there is something to resume). Megatron dialect default False.
    Default True."""
    finetune: bool = False
    """With `load`: the weights only — step 0, a fresh optimizer, no RNG state (Megatron's --finetune).
    Default False."""
    load_optim: bool = True
    """With `load`: also restore the optimizer (AdamW moments, fp32 main parameters, the loss scale);
    False (Megatron's --no-load-optim) starts AdamW fresh from the loaded weights at the saved step.
    Default True."""
    load_rng: bool = True
    """With `load`: also restore each rank's torch RNG state (same world size); False = Megatron's
    --no-load-rng. Dropout masks do not use it (fivefold.model.dropout). Default True."""
