"""The planner's figures in the shape a measurement has, to be compared with one.

callbytes.py sums a rank's collectives (../time/layer_collectives.py, rank_collectives.py) into call
bytes per traffic tag, as the runtime's counter records them; versus.py sets a measured rank's bytes
and peak memory beside the estimate (benchmarks/planner_vs_measured.py, tests/test_planner_measured.py).
A new traffic tag is counted where its call is listed, in ../time; a new measured quantity goes in
versus.py.
"""
