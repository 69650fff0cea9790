"""The lightning indexer: its queries' rounding, its scores over the compressed keys and the top-k as the
MQA kernel's lists."""
