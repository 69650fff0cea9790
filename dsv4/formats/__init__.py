"""Formats and rules that options of several groups share, below the strategies and the kernels: what a
stored row is (`row_format`), what the indexer's queries and keys become (`indexer_numerics`). It imports
nothing of the package but its size rules, so the kernels can read it."""
