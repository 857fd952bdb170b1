"""The fused kernels' AVX2 paths on an AVX-512 machine: the build here takes the widest path the CPU
has, so the native tests are run again in a child process whose builds leave AVX-512 out
(`OURO_NATIVE_CFLAGS=-mno-avx512f`, its own cache), every family reporting `avx2`. Each path is then
held to the same references (the portable loops are switched on at run time by the tests themselves).
Slow: every family built again (~1 min) and the native tests run (~40 s)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ouro.machine_cache import cpuinfo
from ouro.native import build, kernels

ROOT = Path(__file__).resolve().parents[2]
# families that report their path (`<family>_isa`); oneDNN's product picks its own
REPORTING = [f for f in kernels.FAMILIES if f != "onednn"]


@pytest.mark.slow
def test_native_tests_pass_on_the_avx2_paths(tmp_path):
    flags = cpuinfo("flags", "Features").split()
    if "avx512f" not in flags or "avx2" not in flags:
        pytest.skip("the AVX2 paths are this machine's own (tested by the default run)")
    if not kernels.load("mla"):
        pytest.skip("no compiler here")
    env = {**os.environ, build.EXTRA_CFLAGS_ENV: "-mno-avx512f", "OURO_CACHE": str(tmp_path / "cache")}
    report = ("from ouro.native import kernels\n"
              f"print(' '.join(kernels.isa(f) if kernels.load(f) else 'none' for f in {REPORTING!r}))")
    isas = subprocess.run([sys.executable, "-c", report], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert isas.returncode == 0, isas.stderr[-2000:]
    assert isas.stdout.split() == ["avx2"] * len(REPORTING), isas.stdout
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow",
                          "tests/native"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-4000:]
    assert " passed" in run.stdout.splitlines()[-1]
