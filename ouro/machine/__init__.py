"""What ouro measures about the machine it runs on, once, and keeps in `$OURO_CACHE`: which dtype
`--dtype auto` means (`dtype_pick`), how each projection's product runs fastest (`gemm_pick`), and
whether the machine was quiet enough for a timing to be kept (`load`). The cache's storage itself
(`ouro.machine_cache`) sits below `ouro.native`, which keeps its builds there, so this package may
use native kernels (gemv is one of the forms timed) without an import circle."""
