"""ouro's glm5_next forward against transformers' on checkpoints transformers itself saved."""

import pytest
import torch

from hf_reference import rel_rms
from ouro.engine.simple_runner import SimpleRunner

SHAPES = ["tiny", "shared"]
TOL = 1e-4


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.as_tensor(ids).view(1, -1)).logits[0]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("length", [1, 7, 64, 300])
def test_prefill_matches(hf_pair, shape, length):
    _, hf, model = hf_pair(shape)
    ids = torch.randint(0, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(length))
    runner = SimpleRunner(model, 1, 512, poison=True)  # NaN cache: a read of unwritten memory would show
    out = runner.step([ids.tolist()], logits="all")
    assert out.shape == (length, model.config.vocab_size)
    assert rel_rms(out, hf_logits(hf, ids)) <= TOL


@pytest.mark.parametrize("shape", SHAPES)
def test_decode_matches_transformers_cache(hf_pair, shape):
    """40 decode steps after a 200-token prompt: ouro's recurrent/absorbed decode path against
    transformers with its own cache, token for token."""
    _, hf, model = hf_pair(shape)
    ids = torch.randint(0, model.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(7))
    runner = SimpleRunner(model, 1, 256, poison=True)
    worst = 0.0
    with torch.no_grad():
        ref = hf(ids, use_cache=True)
        cache = ref.cache
        out = runner.step([ids[0].tolist()])
        worst = max(worst, rel_rms(out[0], ref.logits[0, -1]))
        for _ in range(40):
            tok = int(ref.logits[0, -1].argmax())
            assert int(out[0].argmax()) == tok
            ref = hf(torch.tensor([[tok]]), cache=cache, use_cache=True)
            cache = ref.cache
            out = runner.step([[tok]])
            worst = max(worst, rel_rms(out[0], ref.logits[0, -1]))
    assert worst <= TOL


@pytest.mark.parametrize("shape", SHAPES)
def test_chunked_prefill_matches_full(hf_pair, shape):
    _, hf, model = hf_pair(shape)
    ids = torch.randint(0, model.config.vocab_size, (200,), generator=torch.Generator().manual_seed(3))
    runner = SimpleRunner(model, 1, 256, poison=True)
    parts = [runner.step([ids[s:s + 17].tolist()], logits="all") for s in range(0, 200, 17)]
    assert rel_rms(torch.cat(parts), hf_logits(hf, ids)) <= TOL


@pytest.mark.parametrize("shape", SHAPES)
def test_flat_batch_matches_each_alone(hf_pair, shape):
    """Three sequences of different lengths in one flat batch (cu_seqlens), then a mixed step where
    one decodes, one continues with a chunk and one is idle."""
    _, hf, model = hf_pair(shape)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (37, 120, 5)]
    runner = SimpleRunner(model, 3, 256, poison=True)
    out = runner.step(seqs, logits="all")
    off = 0
    for s in seqs:
        assert rel_rms(out[off:off + len(s)], hf_logits(hf, s)) <= TOL
        off += len(s)
    extra = [[11], [], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    out = runner.step(extra, logits="all")
    assert rel_rms(out[:1], hf_logits(hf, seqs[0] + extra[0])[-1:]) <= TOL
    assert rel_rms(out[1:], hf_logits(hf, seqs[2] + extra[2])[-9:]) <= TOL


def test_sparse_selection_is_exercised(hf_pair):
    """The comparisons above mean something only if queries really drop keys: at 300 tokens the
    tiny shape's indexer must keep fewer tokens than the causal prefix."""
    _, _, model = hf_pair("tiny")
    seen = {}
    indexer = next(l.self_attn.indexer for l in model.layers if not l.is_kda)
    handle = indexer.register_forward_hook(lambda m, a, o: seen.setdefault("sel", o))
    SimpleRunner(model, 1, 512).step([list(range(300))], logits="all")
    handle.remove()
    sel = seen["sel"]
    kept = (sel >= 0).sum(-1)
    assert int(kept[-1]) <= model.config.index_topk + model.config.index_kpool - 1 < 300
