"""What the planner is calibrated on and to: the runtimes it models and the published runs.

runtime.py holds each runtime's profile (`Runtime`: its memory traits, its fitted time constants, the
modes its search tries); runs.py reads the published GPU training runs (benchmarks/data/gpu-runs.tsv)
and what their sources state beside the table, cases.py turns a row into planner inputs (`Case`).
benchmarks/calibrate.py compares and refits. A new runtime goes in runtime.py's `PROFILES`; a new
published row in the TSV, with what its source states in runs.py.
"""
