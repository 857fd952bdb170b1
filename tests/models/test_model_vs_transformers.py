"""ouro's glm5_next forward against transformers' on checkpoints transformers itself saved."""

import pytest
import torch

from ouro.lab.reference.compare import selections
from tests.helpers.numerics import rel_rms
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


@pytest.mark.parametrize("shape", SHAPES)
def test_sparse_selection_is_exercised(hf_pair, shape):
    """The comparisons above mean something only if the indexer's choice matters. At 300 tokens, on
    every indexer layer: transformers and ouro select the same tokens; late queries see strictly
    fewer tokens than their causal prefix; their pools are mostly not the first ones (what a
    constant score, i.e. a query ignored, gives under the earlier-pool tie rule) and differ from
    query to query."""
    _, hf, model = hf_pair(shape)
    c = model.config
    ids = torch.randint(0, c.vocab_size, (300,), generator=torch.Generator().manual_seed(9)).tolist()
    late = range(200, 300)
    for layer, (theirs, ours) in selections(hf, model, ids).items():
        differ = [p for p, s in enumerate(ours) if s != theirs[p]]
        assert not differ, f"layer {layer}: ouro selects other tokens than transformers at positions {differ}"
        assert all(len(ours[p]) < p + 1 for p in late)
        pools = [frozenset(t // c.index_kpool for t in ours[p] if t < (p + 1) // c.index_kpool * c.index_kpool)
                 for p in late]
        assert all(len(s) == c.index_topk // c.index_kpool for s in pools)
        constant = frozenset(range(c.index_topk // c.index_kpool))
        assert sum(s == constant for s in pools) < len(late) // 10, f"layer {layer}: mostly the first pools"
        assert len(set(pools)) > len(late) // 2, f"layer {layer}: the same pools for most queries"
