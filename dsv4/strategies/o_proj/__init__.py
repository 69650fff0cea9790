"""o_proj options: inverse RoPE, the grouped `wo_a`, one module per option; what the fp8 ones share
is fp8_common.py."""
