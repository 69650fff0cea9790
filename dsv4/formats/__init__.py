"""Formats and rules that options of several groups share, below the strategies and the kernels: what a
stored row is (`row_format`). It imports nothing of the package but its size rules, so the kernels can
read it."""
