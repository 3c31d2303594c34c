"""fivefold: train Transformers with TP, SP, CP, PP, DP and EP in any combination, and plan the layout."""

__version__ = "0.1.0"
