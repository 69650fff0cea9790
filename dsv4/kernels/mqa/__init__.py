"""Sparse MQA with attention sink over the paged cache: the portable two-pass kernel, the one-pass Hopper
kernels, the plan that picks between them and the merge of a call's splits."""
