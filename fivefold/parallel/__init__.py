"""fivefold.parallel"""
