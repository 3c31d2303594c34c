"""fivefold.model: the Llama-style dense decoder and its Hugging Face import."""
from fivefold.model.decoder import Decoder

__all__ = ["Decoder"]
