"""The engine API RL frameworks call (fivefold.engine.engine) and the RL losses (fivefold.engine.losses)."""
from fivefold.engine.engine import Batch, Engine, TokenStats, split

__all__ = ["Batch", "Engine", "TokenStats", "split"]
