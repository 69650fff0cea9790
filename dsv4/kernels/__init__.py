"""Our own Triton kernels. Imported only by the strategies that use them; on a CPU the tests run them
under TRITON_INTERPRET=1."""

# the GPUs our Triton kernels are built for: bf16 tensor-core dots, NVIDIA Ampere and newer, AMD CDNA2 and newer
TRITON_ARCHS = frozenset({"sm80", "sm86", "sm87", "sm89", "sm90", "sm100", "sm103", "sm110", "sm120", "sm121",
                          "gfx90a", "gfx942", "gfx950"})
# those NVIDIA ones with e4m3 tensor cores (sm89 and newer): our fp8 products
FP8_TRITON_ARCHS = frozenset(a for a in TRITON_ARCHS if a.startswith("sm") and int(a[2:]) >= 89)
# up to this many rows our fp8 product quantizes its rows inside each program, and x's products (the fp8
# projection and the compressors' float weights) are one launch (products/joint_linear.py)
FEW_ROWS = 16
