"""What the indexer options share: our Triton scoring and the device's facts it is planned by, what the
published FP4 numerics need of the model, and the check of an option's `top_k`."""
from __future__ import annotations

from dsv4.formats.fp4 import FP4_BLOCK
from dsv4.strategies.protocols import Needs, TopKStrategy


def triton_scores(q, w, keys, pages, token_request, counts, *, width: int, w_scale: float, prepared=None):
    """The step's scores by our Triton kernel (dsv4/kernels/indexer/indexer_logits.py): rows of the keys' dtype, FP4
    or fp8 records, or e4m3 queries with their scales in w (no per-step plan), planned by the device's
    facts `prepare` resolved (`dsv4.kernels.target.device_target`)."""
    from dsv4.kernels.indexer.indexer_logits import indexer_logits

    return indexer_logits(q, w, keys, pages, token_request, counts, width=width, w_scale=w_scale, target=prepared)


# what the rotation and the FP4 blocks need of the model, and the fix where it has other shapes; what the
# options scored by the torch path (the CPU) or our Triton kernels (a GPU) give: batch invariance (the torch
# path's fixed blocks and stable selection, the kernels' fixed launches)
FP4_NEEDS = Needs(model_multiples=(("index_head_dim", FP4_BLOCK),), model_powers_of_two=("index_head_dim",),
                  fix="indexer=exact", batch_invariant=True)


def check_top_k(option) -> None:
    """An option's `top_k` is a top-k option (configs/indexer/top_k/; the config names one by its name)."""
    if not isinstance(option.top_k, TopKStrategy):
        raise ValueError(f"indexer={option.name}: top_k={option.top_k!r} is not a top-k option "
                         f"(an option of configs/indexer/top_k/, e.g. TritonTopK())")
