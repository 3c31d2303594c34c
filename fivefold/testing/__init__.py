"""fivefold.testing"""
