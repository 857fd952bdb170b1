"""GPU checks (run by benchmarks/gpu_checks.sh on a machine with CUDA; skipped without one)."""

import pytest
import torch

from numerics import rel_rms
from ouro.engine.simple_runner import SimpleRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from ouro.models.presets import make_model
    d = tmp_path_factory.mktemp("tiny_cuda")
    make_model("tiny", d, progress=False)
    return d


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_cuda_logits_match_cpu(tiny_dir, dtype, tol):
    from ouro.models.loader import load_model
    torch.backends.cuda.matmul.allow_tf32 = False
    ids = list(range(1, 200))
    ref = SimpleRunner(load_model(tiny_dir), 1, 256).step([ids], logits="all")
    gpu = load_model(tiny_dir, dtype=dtype, device="cuda")
    out = SimpleRunner(gpu, 1, 256, poison=True).step([ids], logits="all").float().cpu()
    assert rel_rms(out, ref) <= tol


def test_cuda_engine_generates_and_frees(tiny_dir):
    from ouro import LLM, SamplingParams
    llm = LLM(str(tiny_dir), device="cuda", max_memory=256 << 20, page_size=16)
    outs = llm.generate([{"prompt_token_ids": list(range(i, i + 30))} for i in range(6)],
                        SamplingParams(temperature=0.7, seed=1, max_tokens=8, ignore_eos=True))
    assert all(len(o.token_ids) == 8 for o in outs)
    e = llm.engine
    assert e.pages.num_free == e.pages.num_total and e.slots.num_free == e.slots.num_total
