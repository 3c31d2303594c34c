"""fivefold.train"""
