"""The switch between a CPU's host-reading fast paths and the capturable form: inside
`capture_path()` the routed experts read nothing back to the host, and give the same output."""

import pytest
import torch

from tests.helpers.numerics import assert_close
from ouro.machine import gemm_pick
from ouro.config import ModelConfig
from ouro.layers.moe import Experts
from ouro.ops.capture import capture_path, reads_host


def test_reads_host_is_off_inside_capture_path_and_back_after():
    t = torch.zeros(3)
    assert reads_host(t)
    with capture_path():
        assert not reads_host(t)
        with capture_path():
            assert not reads_host(t)
        assert not reads_host(t)
    assert reads_host(t)
    with pytest.raises(RuntimeError):
        with capture_path():
            raise RuntimeError("boom")
    assert reads_host(t)


@pytest.mark.parametrize("T", [1, 5, 24])
def test_experts_read_nothing_on_the_capture_path_and_agree(T, monkeypatch):
    cfg = ModelConfig(hidden_size=16, moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=2)
    layer = Experts(cfg)
    g = torch.Generator().manual_seed(T)
    with torch.no_grad():
        layer.gate_up_proj.copy_(torch.randn(layer.gate_up_proj.shape, generator=g))
        layer.down_proj.copy_(torch.randn(layer.down_proj.shape, generator=g))
    layer.forms = ["packed" if gemm_pick.packable(torch.zeros(2, 2)) else "linear"] * len(gemm_pick.ROWS)
    x = torch.randn(T, 16, generator=g)
    experts = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(T)])
    weights = torch.rand(T, 2, generator=g)
    with torch.no_grad():
        eager = layer(x, weights, experts)
        reads = []
        for name in ("tolist", "item", "__int__"):
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name: reads.append(_n) or _o(self, *a))
        with capture_path():
            captured = layer(x, weights, experts)
        assert reads == [], reads
    assert_close(captured, eager)
