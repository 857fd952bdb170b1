"""The host allocator's thresholds (`ouro.engine.host_allocator`): set by an engine on a CPU, a freed
large activation is reused instead of faulted in again; the switch and glibc's own variables
leave the allocator alone. Each case runs in a fresh interpreter (the thresholds are process-wide)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from ouro.engine import host_allocator

pytestmark = pytest.mark.processes

PROBE = textwrap.dedent("""
    import json, resource, sys, torch
    from ouro.engine.host_allocator import keep_activation_buffers
    ok = keep_activation_buffers() if sys.argv[1] == "set" else False
    def faults_of_a_64_mb_buffer():
        # above glibc's largest dynamic mmap threshold (32 MB): a prefill's [8192, 2048] float32 rows
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(16 << 20).fill_(1.0)         # 64 MB written, then freed
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    faults_of_a_64_mb_buffer()                   # the first one faults in either way
    print(json.dumps({"set": ok, "faults": min(faults_of_a_64_mb_buffer() for _ in range(3))}))
""")


def probe(mode: str, **env) -> dict:
    run = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env})
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(host_allocator.why_not() is not None, reason=f"{host_allocator.why_not()}")
def test_a_freed_activation_is_reused_not_faulted_in_again():
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    plain, kept = probe("plain"), probe("set")
    assert kept["set"] and not plain["set"]
    assert plain["faults"] > pages // 2, plain       # glibc gave the block back: every page faults again
    assert kept["faults"] < pages // 16, kept        # reused from the heap


def test_the_switch_and_glibcs_own_variables_leave_it_alone(monkeypatch):
    for var, value in (("OURO_MALLOC_TUNE", "0"), ("MALLOC_MMAP_THRESHOLD_", "65536")):
        monkeypatch.setenv(var, value)
        assert host_allocator.why_not() is not None
        got = probe("set", **{var: value})
        assert not got["set"]
        monkeypatch.delenv(var)


def test_an_engine_on_a_cpu_sets_it():
    code = textwrap.dedent("""
        from ouro.engine.llm import LLM
        from ouro.engine import host_allocator
        llm = LLM("tiny", max_memory=16 << 20)
        print(host_allocator._STATE.get("set"))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == str(host_allocator.why_not() is None)
