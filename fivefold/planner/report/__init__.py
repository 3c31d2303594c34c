"""What `fivefold plan` and `fivefold estimate` print.

tables.py writes the ranked table, one layout's breakdown and --explain (seeds.py: the seeds' rules
it sets beside the top choice), emit.py the top layout in a dialect (--emit), plot.py the memory bars
(--plot). A new line of text goes in tables.py; a new --emit dialect in emit.py.
"""
