"""`--dtype auto` picks by measurement: the rule, the per-machine cache, the pin, and that what it
picks on this machine is the dtype whose GEMM measured fastest here."""

import json

import pytest
import torch

from ouro.machine import dtype_pick
from ouro.config import EngineConfig


@pytest.fixture
def unpinned(monkeypatch, tmp_path):
    monkeypatch.delenv("OURO_DTYPE_AUTO", raising=False)
    monkeypatch.setenv("OURO_CACHE", str(tmp_path))
    monkeypatch.setenv("OURO_BUSY_LIMIT", "1")      # the caching itself; the limit: test_machine_load.py
    return tmp_path


@pytest.mark.parametrize("bf16, fp32, want", [(900e9, 150e9, "bfloat16"), (1.2e9, 100e9, "float32"),
                                             (110e9, 100e9, "float32"), (0.0, 1.0, "float32")])
def test_rule_takes_bf16_only_where_it_clearly_wins(bf16, fp32, want):
    assert dtype_pick.choose({"bfloat16": bf16, "float32": fp32}) == want


def test_measures_once_then_reads_the_cache(unpinned, monkeypatch):
    calls = []

    def fake_rate(name, device, budget_s=0.15):
        calls.append(name)
        return {"bfloat16": 5e11, "float32": 1e11}[name]
    monkeypatch.setattr(dtype_pick, "gemm_rate", fake_rate)
    assert dtype_pick.pick_dtype("cpu") == "bfloat16"
    assert sorted(calls) == ["bfloat16", "float32"]
    entry = json.loads((unpinned / "dtype_auto.json").read_text())[dtype_pick.machine_key("cpu")]
    assert entry["dtype"] == "bfloat16" and entry["gflop_s"] == {"bfloat16": 500.0, "float32": 100.0}
    assert dtype_pick.pick_dtype("cpu") == "bfloat16" and len(calls) == 2       # cached: no timing
    assert EngineConfig(dtype="auto").torch_dtype() is torch.bfloat16
    # another thread count is another machine key: measured afresh
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(n + 1)
        dtype_pick.pick_dtype("cpu")
        assert len(calls) == 4
    finally:
        torch.set_num_threads(n)


def test_a_corrupt_cache_is_measured_again(unpinned, monkeypatch):
    (unpinned / "dtype_auto.json").write_text("{not json")
    monkeypatch.setattr(dtype_pick, "gemm_rate", lambda name, device, budget_s=0.15: 1.0)
    assert dtype_pick.pick_dtype("cpu") == "float32"
    assert json.loads((unpinned / "dtype_auto.json").read_text())


def test_pin_wins_and_a_bad_pin_is_named(monkeypatch):
    monkeypatch.setenv("OURO_DTYPE_AUTO", "bfloat16")
    assert EngineConfig(dtype="auto").torch_dtype() is torch.bfloat16
    assert EngineConfig(dtype="float32").torch_dtype() is torch.float32       # explicit beats auto
    monkeypatch.setenv("OURO_DTYPE_AUTO", "int8")
    with pytest.raises(ValueError, match="OURO_DTYPE_AUTO"):
        dtype_pick.pick_dtype("cpu")


def test_real_measurement_picks_the_faster_native_dtype(unpinned):
    picked = dtype_pick.pick_dtype("cpu")
    rates = dtype_pick.cached_entry("cpu")["gflop_s"]
    assert picked == dtype_pick.choose(rates) and all(r > 0 for r in rates.values())
