"""The engine API RL frameworks call (fivefold.engine.engine) and the RL losses (fivefold.engine.losses)."""
from fivefold.engine.batch import Batch, TokenStats, split
from fivefold.engine.engine import Engine

__all__ = ["Batch", "Engine", "TokenStats", "split"]
