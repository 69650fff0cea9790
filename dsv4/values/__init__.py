"""The values every floor reads: the model's published shapes (spec), the layer types, the device, the
settings' parsers, the errors, the dtypes, the graph settings and the seam between components and
strategies. Imports nothing of dsv4 above it."""
