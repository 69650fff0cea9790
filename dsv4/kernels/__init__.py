"""Our own GPU kernels (Triton). Imported only by the strategies that use them, on a GPU."""
