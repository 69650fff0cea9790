"""The fp8 products: the blockwise linear, o_proj's grouped product and its inverse-RoPE prologue."""
