"""ouro's native kernels: the build of C++ sources for this CPU (`build`) and the fused decode ops
(`kernels`: loading, fallback, the switches; one Python module per family with its fakes)."""
