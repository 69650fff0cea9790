"""The layer's front and its caches: norms, RoPE and rounding of the step's rows, the compressors' step and
the cache writers."""
