"""GPU checks (run by benchmarks/gpu_checks.sh on a machine with CUDA; skipped without one)."""

import pytest
import torch

from tests.helpers.numerics import rel_rms
from ouro.engine.simple_runner import SimpleRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def tiny_dir(tiny_checkpoint):
    return tiny_checkpoint


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


def test_cuda_compiled_decode_with_cuda_graphs_generates_what_eager_does(tiny_dir):
    """--compile on CUDA: the decode step compiled with mode="reduce-overhead" (CUDA graphs per
    bucket) gives eager's greedy tokens, in float32 without TF32."""
    from ouro import LLM, SamplingParams
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = [{"prompt_token_ids": list(range(i, i + 20 + 3 * i))} for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", max_memory=256 << 20, page_size=16, max_num_seqs=8)
    eager = [o.outputs[0].token_ids for o in LLM(str(tiny_dir), **kw).generate(prompts, params)]
    llm = LLM(str(tiny_dir), compile=True, **kw)
    fast = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert fast == eager and llm.engine.runner.graph.runs > 0


def test_native_tf32_chain_products_order_as_emulated():
    """On CUDA `tf32` is the tensor cores' own TF32: far above fp32 against float64, and tf32x3
    (three native TF32 products) back near fp32; the global setting is restored."""
    from ouro.ops.kda.cp import matmul
    g = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(64, 128, 128, device="cuda", generator=g) for _ in range(2))
    exact = a.double() @ b.double()
    before = torch.backends.cuda.matmul.fp32_precision
    err = {p: rel_rms(matmul(a, b, p).double(), exact) for p in ("fp32", "tf32", "tf32x3")}
    assert torch.backends.cuda.matmul.fp32_precision == before
    assert err["tf32"] > 50 * err["fp32"] and err["tf32x3"] < 4 * err["fp32"], err


# ---- quantisation on the GPU (issue 23): torch._int_mm for W8A8, torch._scaled_mm for FP8 ----

@pytest.mark.parametrize("m, k, n", [(1, 64, 24), (3, 77, 24), (17, 128, 40), (600, 256, 96)])
def test_cuda_int_mm_form_is_exact(m, k, n):
    from ouro.ops.quant import int8_mm_naive
    from ouro.quant import int8_forms
    assert int8_forms.form_runs("int_mm", "cuda") is None
    g = torch.Generator().manual_seed(m + k)
    x = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    out = int8_forms.int8_mm(x.cuda(), w.cuda(), "int_mm").cpu()
    assert torch.equal(out, int8_mm_naive(x, w))


@pytest.mark.parametrize("m, k, n", [(1, 64, 24), (3, 77, 24), (600, 256, 96)])
def test_cuda_scaled_mm_form_matches_the_fp8_reference(m, k, n):
    from ouro.ops.quant import fp8_linear_naive, quantize_rows_fp8
    from ouro.quant import fp8_forms
    assert fp8_forms.form_runs("scaled_mm", "cuda") is None, fp8_forms.form_runs("scaled_mm", "cuda")
    g = torch.Generator().manual_seed(m + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    qw, sw = quantize_rows_fp8(w)
    qx, sx = quantize_rows_fp8(x.cuda())
    out = fp8_forms.fp8_mm(qx, sx, qw.cuda(), sw.cuda(), "scaled_mm").cpu()
    assert rel_rms(out, fp8_linear_naive(x, qw, sw)) < 1e-2          # CUDA's rowwise form writes bf16


@pytest.mark.parametrize("method", ["w8a8", "fp8"])
def test_cuda_quantised_engine_is_batch_invariant_and_close_to_cpu(tiny_dir, method):
    from ouro.engine.llm import LLM
    from ouro.engine.sampling import SamplingParams
    llm = LLM(str(tiny_dir), device="cuda", dtype="bfloat16", max_memory=256 << 20, page_size=16,
              quantization=method, max_num_seqs=8)
    prompts = [[5 + i, 9, 11 + 2 * i, 40, 3] for i in range(6)]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, sp)]
    alone = [llm.generate([p], sp)[0].token_ids for p in prompts]
    assert together == alone
