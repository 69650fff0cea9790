"""indexer.top_k options: how an indexer option's scores become the MQA kernel's lists on a GPU, a group
nested in the indexer's (configs/indexer/top_k/; `indexer.top_k=flashinfer` names one), one module per
option. The CPU path is torch.topk (dsv4/components/indexer.py), their specification.

- `triton`: our one-launch radix select (dsv4/kernels/indexer/topk_lists.py), the page lookup fused in.
- `flashinfer`: FlashInfer's `top_k_ragged_transform` (package flashinfer-python, CUDA; its kernels are
  compiled by FlashInfer's JIT on first use, which needs the CUDA toolkit) for the local indices, then
  our one-launch page lookup (`slot_lists`). Its deterministic mode with ties at the K-th score broken
  towards the lower index: the same set as `triton`'s, the same lists eager and replayed. (Its
  `top_k_page_table_transform` would fuse the lookup but reads a table of one slot per entry, which a
  step would have to build; on the H200 it was also slower than the ragged form.)

Both write valid entries first, so a list's length is its count of them; the order among them is each
kernel's own.
"""
