"""Native kernels: the fused CPU kernels in C (``fused_cpu``), loaded with ctypes."""
