"""Platform-free parts of the layer: norms, RoPE, paged KV pool, compressor, indexer, the module."""
