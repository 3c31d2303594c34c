"""The search: every layout of a space, checked, sized, timed and ranked.

space.py lists the layouts (and the runtime modes the search tries), validity.py checks each by the
config's rules, configs.py makes the configs and their labels, pruning.py drops what cannot win
unsized, ranking.py sizes (../memory), times (../time) and ranks the rest; compare.py places a
stated layout beside the ranking, forward.py estimates a forward-only model (an RL reference). A new
search dimension goes in space.py (and its config field in configs.py); a new shortcut in pruning.py.
"""
