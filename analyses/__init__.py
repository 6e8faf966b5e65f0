"""The analysis scripts behind every committed figure, table and benchmark in figures/ and the
pages, as one package run from the repository root with `python -m analyses.<folder>.<name>`.

`figures/` makes the figures and tables of figures/, `benchmarks/` times and profiles the code,
`studies/` holds one-off measurements whose numbers the pages quote, and `tools/` holds the
helpers the others share plus the checks of the committed data (quoted numbers, provenance,
identical runs). Nothing here is part of the installed `gradlab` package.
"""
