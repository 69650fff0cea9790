"""indexer options: the lightning indexer's numerics, its key record, how keys are scored, one module per
option; what they share: common.py (scoring, FP4 numerics as an option's methods, plain keys),
key_layouts.py (the record layouts of the keys), top_k.py (the `top_k` setting: how scores become lists)."""
