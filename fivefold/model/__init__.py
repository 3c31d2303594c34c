"""fivefold.model: the Llama-style dense decoder and its Hugging Face import."""
from fivefold.model.decoder import Decoder, build_decoder

__all__ = ["Decoder", "build_decoder"]
