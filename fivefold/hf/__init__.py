"""Hugging Face interop, above the model and the checkpoint: a local HF folder's weights into any layout
(`load`), a checkpoint of any layout out as a `save_pretrained` folder (`export`), the config.json written
for each family (`config`) and the name map both share (`names`). Reading an HF config.json into a
`ModelConfig` is pure and lives below, in fivefold.config.hf, where the planner and validation read it too."""
from fivefold.config.hf import config_from_hf
from fivefold.hf.config import hf_config
from fivefold.hf.export import export_hf
from fivefold.hf.load import load_hf, read_hf_shards, state_dict_from_hf
from fivefold.hf.names import hf_name

__all__ = ["config_from_hf", "export_hf", "hf_config", "hf_name", "load_hf", "read_hf_shards", "state_dict_from_hf"]
