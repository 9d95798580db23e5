"""Native kernels: the fused CPU kernels in C (``fused_cpu.c`` and the parts it includes, ``cpu/*.h``; its
enums in ``fused_cpu_specs.h``,
generated from the kernel specs by ``header``), registered as torch ops on the LibTorch stable ABI
by ``native.cpp`` (one library, ``fastoptim/_C``, whose Python face is the CPU backend,
``fastoptim.engines.backends.cpu``)
and the fused GPU kernels in Triton (``fused_triton``, an optional extra)."""
