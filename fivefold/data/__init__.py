"""fivefold.data"""
