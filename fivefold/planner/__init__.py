"""fivefold.planner"""
