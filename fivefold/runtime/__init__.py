"""fivefold.runtime"""
