"""Native kernels: the fused CPU kernels in C (``fused_cpu.c``, loaded with ctypes by
``fused_cpu``; its enums in ``fused_cpu_specs.h``, generated from the kernel specs by ``header``)
and the fused GPU kernels in Triton (``fused_triton``, an optional extra)."""
