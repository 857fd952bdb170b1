"""Context-parallel prefill of the whole model across real processes (gloo on 127.0.0.1): the
ranks' logits, the last rank's KDA states and every rank's DSA cache equal one single-rank
prefill, for a cut mid-chunk and mid-pool, an aligned cut, several sequences, a prefix already in
the cache (nonzero initial state) and three ranks; greedy decode after a CP prefill gives the
single-rank tokens. Weights are random, with every constant-initialised tensor randomised."""

import pytest
import torch

from ouro.machine.model_forms import apply_to
from ouro.layers.context import ForwardContext, ModelCache
from ouro.models.loader import load_model
from ouro.parallel.cp_forward import cp_forward
from ouro.parallel.groups import launch

from ouro.lab.reference.checkpoint import make_hf_checkpoint
from tests.helpers.numerics import rel_rms

pytestmark = pytest.mark.processes

PAGE = 8
MAX_LEN = 96
DECODE_STEPS = 6
# (shape, prompt lengths, cached prefix length, cuts per sequence or None for even ones)
CASES = {
    "cut-mid-chunk-and-pool": ("tiny", [50], 0, [[23]]),
    "aligned": ("tiny", [64], 0, [[32]]),
    "several-sequences": ("tiny", [50, 37], 0, None),
    "nonzero-initial-state": ("tiny", [61], 21, [[17]]),
    "shared-indexers": ("shared", [58, 45], 9, None),
}


def prompts_of(case):
    shape, lengths, prefix, _ = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    return [torch.randint(1, 300, (n,), generator=g).tolist() for n in lengths]


def new_cache(model, n_seqs):
    pages = -(-MAX_LEN // PAGE)
    cache = ModelCache(model.config, n_seqs, n_seqs * pages, PAGE)
    cache.poison()                 # a row no rank wrote shows up as NaN
    return cache, torch.arange(n_seqs * pages).view(n_seqs, pages)


def forward(model, cache, table, tokens, start, logits="last"):
    ctx = ForwardContext.build(cache, [len(t) for t in tokens], start, list(range(len(tokens))), table, logits=logits)
    return model(torch.tensor([t for s in tokens for t in s]), ctx)


def greedy(model, cache, table, prompts, first_logits):
    """DECODE_STEPS greedy tokens per sequence after the prompts are in `cache`."""
    toks = [[int(r.argmax())] for r in first_logits]
    for _ in range(DECODE_STEPS - 1):
        out = forward(model, cache, table, [[t[-1]] for t in toks], [len(p) + len(t) - 1 for p, t in zip(prompts, toks)])
        for t, r in zip(toks, out):
            t.append(int(r.argmax()))
    return toks


def snapshot(cache, prompts, table):
    """The prompts' DSA rows (latent, indexer keys, gates, pooled keys) and the KDA states."""
    ps = cache.page_size
    rows = torch.cat([table[b, torch.arange(len(p)) // ps] * ps + torch.arange(len(p)) % ps for b, p in enumerate(prompts)])
    flat = lambda t: t.reshape(t.shape[0], -1, t.shape[-1])[:, rows]
    kp = ps // cache.index_pooled.shape[2]
    first = lambda p: torch.arange(len(p) // kp) * kp            # first token of each complete pool
    pools = torch.cat([(table[b, first(p) // ps] * ps + first(p) % ps) // kp for b, p in enumerate(prompts)])
    return dict(latent=flat(cache.latent), keys=flat(cache.index_keys), gates=flat(cache.index_gates),
                pooled=cache.index_pooled.reshape(cache.index_pooled.shape[0], -1, cache.index_pooled.shape[-1])[:, pools],
                conv=cache.conv.clone(), recurrent=cache.recurrent.clone())


def run_case(model, case, cp_group=None):
    """Prefix (single-rank, on every rank alike), then the rest single-rank or CP; the logits of
    every new token (per sequence), the cache snapshot and the greedy continuation."""
    _, _, prefix, cuts = CASES[case]
    prompts = prompts_of(case)
    cache, table = new_cache(model, len(prompts))
    start = [0] * len(prompts)
    if prefix:
        forward(model, cache, table, [p[:prefix] for p in prompts], start)
        start = [prefix] * len(prompts)
    rest = [p[prefix:] for p in prompts]
    if cp_group is None:
        logits = forward(model, cache, table, rest, start, logits="all")
        per_seq = list(logits.split([len(r) for r in rest]))
    else:
        logits, bounds = cp_forward(model, cache, cp_group, rest, start, list(range(len(prompts))), table,
                                    cuts=cuts, logits="all")
        rank = torch.distributed.get_rank(cp_group)
        per_seq = list(logits.split([bd[rank + 1] - bd[rank] for bd in bounds]))
    last = torch.stack([s[-1] for s in per_seq])
    return dict(logits=per_seq, cache=snapshot(cache, prompts, table), tokens=greedy(model, cache, table, prompts, last))


def rank_work(groups, checkpoints, cases):
    out = {}
    for case in cases:
        model = load_model(checkpoints[CASES[case][0]])
        apply_to(model)
        out[case] = run_case(model, case, groups.cp)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}
    for shape in sorted({c[0] for c in CASES.values()}):
        d = tmp_path_factory.mktemp(f"cp_{shape}")
        make_hf_checkpoint(shape, d)
        made[shape] = d
    return made


def references(checkpoints):
    out = {}
    for case in CASES:
        model = load_model(checkpoints[CASES[case][0]])
        apply_to(model)
        out[case] = run_case(model, case)
    return out


def check(results, refs, case):
    ranks = len(results)
    ref = refs[case]
    for b, want in enumerate(ref["logits"]):        # the ranks' slices, in order, make the whole
        got = torch.cat([results[r][case]["logits"][b] for r in range(ranks)])
        assert got.shape == want.shape and not got.isnan().any(), case
        assert rel_rms(got, want) < 1e-4, (case, b, rel_rms(got, want))
    last = results[-1][case]
    for name in ("conv", "recurrent"):              # the request's KDA state: on the last rank
        assert not last["cache"][name].isnan().any() and rel_rms(last["cache"][name], ref["cache"][name]) < 1e-4, (case, name)
    for r in range(ranks):                          # the prompt's DSA cache: on every rank
        for name in ("latent", "keys", "gates", "pooled"):
            got = results[r][case]["cache"][name]
            assert not got.isnan().any(), (case, r, name)
            assert rel_rms(got, ref["cache"][name]) < 1e-4, (case, r, name)
    assert last["tokens"] == ref["tokens"], case


@pytest.fixture(scope="module")
def two_ranks(checkpoints):
    return launch(rank_work, 2, checkpoints, list(CASES), timeout_s=300), references(checkpoints)


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_equal_one_rank(two_ranks, case):
    results, refs = two_ranks
    check(results, refs, case)


@pytest.mark.slow
def test_three_ranks_equal_one_rank(checkpoints):
    cases = ["several-sequences", "shared-indexers"]
    results = launch(rank_work, 3, checkpoints, cases, timeout_s=300)
    refs = references(checkpoints)
    for case in cases:
        check(results, refs, case)
