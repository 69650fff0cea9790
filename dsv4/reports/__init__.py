"""Rows and tables: a run's result row and printed table, a sweep's records, its summary and heatmaps."""
