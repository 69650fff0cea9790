"""Our own Triton kernels. Imported only by the strategies that use them; on a CPU the tests run them
under TRITON_INTERPRET=1."""
