"""A preset written under $OURO_CACHE by processes that start side by side (test workers, servers,
engine workers on a fresh cache): one writes it, under an OS lock, beside its place and moved in
whole; the others wait and read the complete checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ouro.machine_cache import cache_lock

pytestmark = pytest.mark.processes

RESOLVE = ("from ouro.models.resolve import resolve_model; from ouro.models.loader import load_model; "
           "d = resolve_model('tiny', progress=False); load_model(d); print('loaded', d)")


def _start(cache):
    return subprocess.Popen([sys.executable, "-c", RESOLVE], env={**os.environ, "OURO_CACHE": str(cache)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_processes_side_by_side_on_a_fresh_cache_all_load_one_whole_preset(tmp_path):
    procs = [_start(tmp_path) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "loaded" in out, err[-2000:]
    presets = tmp_path / "presets"
    assert sorted(p.name for p in presets.iterdir() if not p.name.endswith(".lock")) == ["tiny"]   # no partial left


def test_a_writer_holding_the_lock_keeps_readers_out_until_it_is_done(tmp_path):
    with cache_lock(tmp_path / "presets" / "tiny.lock"):
        p = _start(tmp_path)
        time.sleep(3)
        assert p.poll() is None, p.communicate()          # waiting on the lock, not reading a half-written preset
        assert not (tmp_path / "presets" / "tiny").exists()
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0 and "loaded" in out, err[-2000:]
