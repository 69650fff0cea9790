"""dsv4: the DeepSeek-V4 sparse-MLA attention layer, composed from injected strategies."""
