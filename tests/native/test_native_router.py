"""The MoE router as a native op (`ouro/native/router.cpp`) against the eager code it replaces, on
every path this machine runs. Its product is its own: it picks the eager code's experts, in its
order, wherever the float64 scores separate them by more than float32 rounding (`TOL`), and a choice
the exact scores allow where they do not; its exact ties (duplicate router rows, zero rows) are
broken as torch.topk breaks them; its weights are within float32 rounding; a token's result is the
same at any batch size and thread count."""

import contextlib

import pytest
import torch

from tests.helpers.numerics import rel_rms
from ouro.native import kernels
from ouro.native import router as fr
from ouro.ops import batch_invariant
from ouro.ops.moe import route


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        assert fr.can(torch.ones(1)), kernels.why_not("router")
        yield


def path_of(path):
    return kernels.portable("router") if path == "portable" else contextlib.nullcontext()


def eager_route(x, w, bias, *args):
    return route(x.float() @ w.float().T, bias, *args)


# two float32 products of a row of D <= 64 (sigmoid scores in (0, 1)) differ by far less than this
TOL = 1e-5


def exact_choice(x, w, bias, top_k, n_group, topk_group, norm_topk, scaling):
    """float64 throughout: (scores [T, E], choice values [T, E] with dropped groups at -inf, group
    scores [T, n_group], the kept groups' k-th score [T]) of the routing rule."""
    scores = torch.sigmoid((x.double()[:, None, :] * w.double()[None]).sum(-1))   # equal rows, equal logits
    choice = scores + bias.double()
    T, E = choice.shape
    group = choice.view(T, n_group, E // n_group).topk(2, -1).values.sum(-1) if n_group > 1 else choice[:, :1]
    kth = group.topk(topk_group, -1).values[:, -1]
    return scores, choice, group, kth


def clear_rows(x, w, bias, args, ties_ok=False):
    """Rows whose float64 choice is separated from every alternative by TOL or more (the kept groups
    from the next, each chosen expert from the next in order and from the best one left out); with
    `ties_ok`, exact ties (equal router rows) count as separated too."""
    top_k, n_group, topk_group = args[:3]
    _, choice, group, _ = exact_choice(x, w, bias, *args)
    T, E = choice.shape

    def near(gaps):
        return bool(((gaps < TOL) & ((gaps != 0) | (not ties_ok))).any())
    clear = torch.ones(T, dtype=torch.bool)
    for t in range(T):
        if n_group > 1:
            g = group[t].sort(descending=True).values
            if near(g[:-1] - g[1:]):
                clear[t] = False
                continue
            kept = group[t].topk(topk_group).indices
            per = E // n_group
            c = torch.cat([choice[t, int(k) * per:(int(k) + 1) * per] for k in kept])
        else:
            c = choice[t]
        v = c.sort(descending=True).values[:top_k + 1]
        if len(v) > 1 and near(v[:-1] - v[1:]):
            clear[t] = False
    return clear


def assert_allowed(got_w, got_e, x, w, bias, args):
    """Each row's choice is one the exact scores allow up to TOL: groups that can be the best
    topk_group, each chosen expert no worse than any left out of them, in descending order; the
    weights of the chosen."""
    top_k, n_group, topk_group, norm_topk, scaling = args
    scores, choice, group, kth = exact_choice(x, w, bias, *args)
    T, E = choice.shape
    per = E // n_group
    for t in range(T):
        e = got_e[t]
        assert len(set(e.tolist())) == top_k
        used = set((e // per).tolist())
        assert len(used) <= topk_group and all(group[t, g] >= kth[t] - TOL for g in used), (t, e)
        c = choice[t, e]
        assert ((c[:-1] - c[1:]) >= -TOL).all(), (t, e)
        # the kept groups: those the choice used, those that must stay (above the k-th by TOL), then
        # the near-k-th ones whose best expert is least (the most lenient set the scores allow)
        best = choice[t].view(n_group, per).max(-1).values
        must = [g for g in range(n_group) if group[t, g] > kth[t] + TOL and g not in used]
        maybe = sorted((g for g in range(n_group) if kth[t] - TOL <= group[t, g] <= kth[t] + TOL and g not in used),
                       key=lambda g: float(best[g]))
        kept = (sorted(used) + must + maybe)[:topk_group]
        left = torch.zeros(E, dtype=torch.bool)
        for g in kept:
            left[g * per:(g + 1) * per] = True
        left[e] = False
        assert not left.any() or c.min() >= choice[t][left].max() - TOL, (t, e)
    want = scores.gather(1, got_e)
    want = (want / (want.sum(-1, keepdim=True) + 1e-20) if norm_topk else want) * scaling
    assert rel_rms(got_w, want) <= 3e-7


def check_route(x, w, bias, args, path="native", ref=None):
    """The fused router against `ref` (the eager code by default) on every clear row, and allowed on all."""
    ref_w, ref_e = ref if ref is not None else eager_route(x, w, bias, *args)
    with path_of(path):
        got_w, got_e = fr.route(x, w, bias, *args)
    clear = clear_rows(x, w, bias, args)
    assert clear.float().mean() >= 0.75, "too few rows separated by more than rounding: the check would say little"
    assert torch.equal(got_e[clear], ref_e[clear]), args
    assert rel_rms(got_w[clear], ref_w[clear]) <= 1e-6
    assert_allowed(got_w, got_e, x, w, bias, args)
    return got_w, got_e


GROUPINGS = [(8, 1, 1, 2), (8, 4, 2, 3), (32, 1, 1, 4), (32, 4, 2, 4), (32, 8, 3, 6), (64, 8, 3, 6), (64, 4, 4, 8),
             (96, 8, 8, 8), (96, 4, 1, 5), (12, 3, 2, 3), (10, 2, 1, 3), (6, 1, 1, 2),
             (288, 1, 1, 8)]       # (E, n_group, topk_group, top_k); 288 x top-8: GLM-5.3-Flash's router


@pytest.mark.parametrize("path", ["native", "portable"])
@pytest.mark.parametrize("T", [1, 5, 16, 64])
@pytest.mark.parametrize("E,n_group,topk_group,top_k", GROUPINGS)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("D", [40, 512])
def test_route_equals_eager_and_float64(path, T, E, n_group, topk_group, top_k, norm, D):
    g = torch.Generator().manual_seed(T * E + top_k + D)
    x, w, bias = torch.randn(T, D, generator=g), torch.randn(E, D, generator=g) / 6, torch.randn(E, generator=g) * 0.1
    w = w * (40 / D) ** 0.5
    args = (top_k, n_group, topk_group, norm, 2.5)
    got_w, got_e = check_route(x, w, bias, args, path)
    w64, _ = eager_route(x.double(), w.double(), bias.double(), *args)
    ref_w, _ = eager_route(x, w, bias, *args)
    assert rel_rms(got_w, w64) <= 2 * rel_rms(ref_w, w64) + 3e-7


def tie_reference(x, w, bias, args):
    """The eager routing of logits that tie exactly where router rows repeat (float64 products rounded
    once); T * E a multiple of 16, so torch's sigmoid takes every score through its vector body."""
    return route((x.double()[:, None, :] * w.double()[None]).sum(-1).float(), bias, *args)


@pytest.mark.parametrize("E,n_group,topk_group,top_k", GROUPINGS)
@pytest.mark.parametrize("distinct", [1, 2, 3, 5])
def test_route_exact_ties_pick_the_eager_experts(E, n_group, topk_group, top_k, distinct):
    """Equal scores (duplicate router rows with equal biases) and hence equal group scores: torch.topk's
    order among equal values is no fixed rule (topk([1, 3, 3, 2, 3], 2) gives indices [2, 4]),
    and the fused router reproduces it."""
    g = torch.Generator().manual_seed(E * 7 + distinct)
    D = 16
    kinds = torch.randint(0, distinct, (E,), generator=g)
    w = torch.randn(distinct, D, generator=g)[kinds]
    x = torch.randn(32, D, generator=g)
    for bias in (torch.zeros(E), (torch.randint(0, 2, (distinct,), generator=g).float() * 0.5)[kinds]):
        args = (top_k, n_group, topk_group, True, 1.0)
        ref_w, ref_e = tie_reference(x, w, bias, args)
        got_w, got_e = fr.route(x, w, bias, *args)
        rows = clear_rows(x, w, bias, args, ties_ok=True)
        assert rows.float().mean() >= 0.75
        assert torch.equal(got_e[rows], ref_e[rows]) and rel_rms(got_w, ref_w) <= 1e-6, args
        assert_allowed(got_w, got_e, x, w, bias, args)
        zero = torch.zeros(3, D)             # every logit 0: the eager code's own scores tie as well
        ref_w, ref_e = eager_route(zero, w, bias, top_k, n_group, topk_group, False, 1.0)
        got_w, got_e = fr.route(zero, w, bias, top_k, n_group, topk_group, False, 1.0)
        assert torch.equal(got_e, ref_e) and torch.equal(got_w, ref_w)


def test_route_group_ties_and_near_ties():
    """Group 2 a copy of group 0 (equal group scores: torch.topk's order, as in the reference whose
    copies tie too), and experts one float32 step apart (either order is the rounded answer)."""
    D, E = 16, 32
    g = torch.Generator().manual_seed(1)
    w = torch.randn(E, D, generator=g)
    w[16:24] = w[0:8]
    w[5], w[9], w[20] = w[3], w[3], w[3]
    w[11] = w[10] * (1 + 2 ** -23)
    w[27] = w[26].nextafter(w[26] + 1)
    x = torch.randn(32, D, generator=g)
    for args in ((4, 4, 2, True, 1.0), (6, 1, 1, False, 1.0), (3, 4, 1, True, 1.0), (8, 8, 3, True, 2.5)):
        got_w, got_e = fr.route(x, w, torch.zeros(E), *args)
        assert_allowed(got_w, got_e, x, w, torch.zeros(E), args)
        ref_w, ref_e = tie_reference(x, w, torch.zeros(E), args)
        rows = clear_rows(x, w, torch.zeros(E), args, ties_ok=True)     # no near-tied pair in the choice
        assert rows.sum() >= 8
        assert torch.equal(got_e[rows], ref_e[rows]), args


def test_route_nan_rows_match_eager():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(4, 16, generator=g), torch.randn(32, 16, generator=g)
    x[1, 3] = float("nan")
    w[7, 0] = float("nan")
    ref_w, ref_e = eager_route(x, w, torch.zeros(32), 4, 4, 2, True, 1.0)
    got_w, got_e = fr.route(x, w, torch.zeros(32), 4, 4, 2, True, 1.0)
    assert torch.equal(got_e, ref_e)
    assert torch.equal(got_w.isnan(), ref_w.isnan())


@pytest.mark.parametrize("path", ["native", "portable"])
def test_route_is_batch_invariant_and_takes_deterministic_mode(path):
    """A token's choice and weights are the same bits alone, in any batch and on any thread count, and
    deterministic mode (whose eager product is batch-invariant too) keeps the fused op."""
    g = torch.Generator().manual_seed(3)
    x, w, bias = torch.randn(37, 512, generator=g), torch.randn(32, 512, generator=g) / 30, torch.randn(32, generator=g) / 10
    args = (4, 4, 2, True, 2.5)
    threads = torch.get_num_threads()
    with path_of(path):
        whole_w, whole_e = fr.route(x, w, bias, *args)
        try:
            torch.set_num_threads(1)
            one_thread = fr.route(x, w, bias, *args)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one_thread[0], whole_w) and torch.equal(one_thread[1], whole_e)
        for rows in (slice(5, 6), slice(0, 3), slice(3, 20), slice(33, 37)):
            part_w, part_e = fr.route(x[rows], w, bias, *args)
            assert torch.equal(part_w, whole_w[rows]) and torch.equal(part_e, whole_e[rows])
    batch_invariant.enable()
    try:
        check_route(x, w, bias, args)
    finally:
        batch_invariant.disable()


def test_route_refuses_a_bad_grouping():
    with pytest.raises(RuntimeError, match="groups"):
        fr.route(torch.randn(2, 8), torch.randn(10, 8), torch.zeros(10), 2, 4, 2, True, 1.0)
