"""linear options: how the layer's dense projections store their weights and multiply, one module per
option; what they share is common.py."""
