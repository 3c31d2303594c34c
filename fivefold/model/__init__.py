"""fivefold.model"""
