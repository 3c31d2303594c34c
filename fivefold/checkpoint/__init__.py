"""fivefold.checkpoint"""
