"""What the indexer options share: our Triton scoring, no per-step plan where scoring needs none, the
published FP4 numerics as an option's `queries`, `keys` and `needs`, and plain keys in the activation
dtype (no record of their own)."""
from __future__ import annotations

from typing import Any

from dsv4.formats.fp4 import FP4_BLOCK, fp4_sim
from dsv4.strategies.protocols import Needs


def triton_scores(q, w, keys, pages, token_request, counts, *, width: int, w_scale: float, plan=None, prepared=None):
    """The step's scores by our Triton kernel (dsv4/kernels/indexer_logits.py): rows of the keys' dtype,
    FP4 or fp8 records (no per-step plan), planned by the device's facts `triton_prepare` resolved."""
    from dsv4.kernels.indexer_logits import indexer_logits

    return indexer_logits(q, w, keys, pages, token_request, counts, width=width, w_scale=w_scale, target=prepared)


def no_prepare(self, *, head_dim: int, device) -> Any:
    """An option's `prepare` when its transforms and its scoring need nothing made on the device."""
    return None


def triton_prepare(self, *, head_dim: int, device) -> Any:
    """An option's `prepare` when our Triton kernel scores its keys and its transforms need nothing: on a GPU
    the device's facts the kernel's calls are planned by (dsv4.kernels.launch.target), resolved once; None
    elsewhere (the torch path scores)."""
    platform = getattr(device, "platform", None)
    if platform not in ("cuda", "rocm"):
        return None
    from dsv4.kernels.launch import target

    return target(platform=platform, arch=device.arch, torch_device=device.torch_device)


def no_plan(self, *, token_request, counts, pages, block_size: int) -> None:
    """An option's `plan` when its scoring needs nothing made per step."""
    return None


def fp4_queries(self, q, prepared=None):
    """The FP4 options' `queries`: RoPE'd queries [..., Di] -> rotated, FP4-simulated, float32 (bf16 values)."""
    return fp4_sim(q)


def fp4_keys(self, rows, prepared=None):
    """The FP4 options' `keys`: closed keys [N, Di] after norm and RoPE -> rotated, FP4-simulated, float32
    (bf16 values)."""
    return fp4_sim(rows)


# what the rotation and the blocks need of the model, and the fix where it has other shapes
FP4_NEEDS = {"model_multiples": (("index_head_dim", FP4_BLOCK),), "model_powers_of_two": ("index_head_dim",),
             "fix": "indexer=exact"}


def fp4_needs(self, device) -> Needs:
    """The FP4 options' `needs` where their scoring is ours: the rotation's and the blocks' alone."""
    return Needs(**FP4_NEEDS)


def plain_keys(self, *, dtype: str, head_dim: int) -> None:
    """The `key_layout` of options that keep no record of their own: None, their keys are plain rows in the
    activation dtype (the pool makes them a PlainRowLayout): float32 activations keep exact keys; bf16 ones
    store bf16 keys, as the published inference code does (its indexer cache is a bf16 tensor scored by a
    bf16 product)."""
    return None
