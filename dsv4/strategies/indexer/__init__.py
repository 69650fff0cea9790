"""indexer options: the lightning indexer's numerics, its key record, how keys are scored, one module per
option; what they share: common.py (our scoring, what the FP4 numerics need), key_layouts.py (the record
layouts of the keys); top_k/, a group nested in this one (`indexer.top_k`: how scores become lists)."""
