"""Step time: compute, each collective on the link it crosses, and the pipeline bubble.

steptime.py assembles a step from its pipeline ranks (the bubble from ../pipeline.py); layer_cost.py
times one decoder layer (flops.py counts its FLOPs); layer_collectives.py and rank_collectives.py list
every call a rank makes, calls.py times them on their links (links.py), time_assumptions.py holds the
calibratable constants. A new call goes in the collectives' lists (the measured byte checks read the
same list); a new compute term in layer_cost.py; a new constant in time_assumptions.py.
"""
