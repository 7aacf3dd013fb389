"""The benchmarks that check tfdist itself, and the hand-written jobs they race it against.

`tfdist bench NAME` runs them from a source checkout (they are not in the installed package):
see README.md here and docs/figures.md.
"""
