"""Every instruction-set path of the int8 kernel against the exact reference, on this machine: the
build here takes the widest path the CPU has, so the others are built too, with the flags that
select them (-DOURO_NO_512: 256-bit VNNI; no VNNI: the 16-bit AVX2 path; no AVX2: the portable
loops). Slow: three builds of ~30 s."""

from __future__ import annotations

import pytest
import torch

from ouro.native.build import CFLAGS
from ouro.ops.quant import int8_mm_naive, quantize_rows
from ouro.quant import int8_native
from ouro.quant.int8_native import native

VARIANTS = {"vnni256": ["-DOURO_NO_512"], "avx2": ["-mno-avx512vnni", "-mno-avxvnni"],
            "portable": ["-mno-avx2", "-mno-avx512f"]}
EXPECT = {"vnni256": ("avx2+vnni",), "avx2": ("avx2",), "portable": ("scalar",)}


def flags_here() -> str:
    from ouro.machine_cache import cpuinfo
    return cpuinfo("flags", "Features")


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_path_is_exact(variant, tmp_path):
    if native() is None:
        pytest.skip("no compiler here")
    have = flags_here().split()
    if variant == "vnni256" and not ({"avx512_vnni", "avx_vnni"} & set(have)):
        pytest.skip("no VNNI on this CPU")
    if variant == "avx2" and "avx2" not in have:
        pytest.skip("no AVX2 on this CPU")
    from torch.utils import cpp_extension
    source, headers = int8_native.BUILD[1], int8_native.BUILD[2]
    m = cpp_extension.load(name=f"ouro_int8_{variant}", sources=[str(source)],
                           extra_cflags=[*CFLAGS, *VARIANTS[variant], f"-Douro_int8=ouro_int8_{variant}"],
                           extra_include_paths=sorted({str(h.parent) for h in headers}), build_directory=str(tmp_path))
    assert m.features() in EXPECT[variant]
    g = torch.Generator().manual_seed(0)
    none = torch.zeros(0, dtype=torch.long)
    for M, K, N in ((1, 7, 5), (3, 77, 24), (33, 40, 17), (5, 512, 136), (64, 101, 300), (129, 64, 33)):
        x = torch.randint(-127, 128, (M, K), generator=g, dtype=torch.int8)
        w = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
        assert torch.equal(m.int8_mm(x, w), int8_mm_naive(x, w)), (M, K, N)
        xf = torch.randn(M, K, generator=g)
        q, s = quantize_rows(torch.randn(N, K, generator=g))
        qx, sx = quantize_rows(xf)
        want = int8_mm_naive(qx, q).float() * sx[:, None] * s[None, :]
        assert torch.equal(m.w8a8_packed(xf, m.pack_weight(q.unsqueeze(0)), s, none, N), want), (M, K, N)
