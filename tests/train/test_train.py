"""`ouro train`: its kernel swap, indexer distillation, balance, reproducible resume, and a smoke
run through the CLI whose checkpoint ouro loads with transformers' logits."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.numerics import rel_rms
from ouro.config import ModelConfig
from ouro.eval.corpus import corpus_files, is_held_out, load_split
from ouro.models.presets import PRESETS

pytest.importorskip("transformers")
from ouro.train import hf_model  # noqa: E402
from ouro.train.indexer_distill import (LayerInputs, candidate_mask, dense_pool_mass, indexer_pool_scores,  # noqa: E402
                                        selection_recall)

ROOT = Path(__file__).resolve().parents[2]


def write_corpus(root: Path, n: int = 40) -> Path:
    """A small corpus of .py files (ouro's own sources, repeated under several names), plus test
    files and directories that must be left out."""
    root.mkdir(parents=True, exist_ok=True)
    sources = sorted((ROOT / "ouro").rglob("*.py"))
    i = held = 0
    while i < n or held < 3:                 # names are picked until some hash into held-out
        src = sources[i % len(sources)]
        rel = f"pkg{i % 4}/m{i}_{src.name}"
        (root / f"pkg{i % 4}").mkdir(exist_ok=True)
        (root / rel).write_text(src.read_text())
        held += is_held_out(rel)
        i += 1
    (root / "tests").mkdir(exist_ok=True)
    (root / "tests" / "leak.py").write_text("LEAK = 1\n")
    (root / "pkg0" / "test_leak.py").write_text("LEAK = 2\n")
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def test_corpus_split_is_by_file_disjoint_and_leaves_out_tests(corpus):
    files = corpus_files(corpus)
    rel = {f.relative_to(corpus).as_posix() for f in files}
    assert "tests/leak.py" not in rel and "pkg0/test_leak.py" not in rel
    assert not any(f.read_text().startswith("LEAK =") for f in files)
    files = [f for f in files if f.read_text()]                  # empty files are skipped
    train, held = load_split("train", corpus), load_split("held_out", corpus)
    assert {d.path for d in train}.isdisjoint({d.path for d in held})
    assert len(train) + len(held) == len(files) and held
    assert all(is_held_out(d.path) for d in held) and not any(is_held_out(d.path) for d in train)
    assert [d.path for d in load_split("held_out", corpus)] == [d.path for d in held]   # deterministic
    capped = load_split("train", corpus, max_bytes=1)
    assert len(capped) == 1                                                         # whole files, at least one
    with pytest.raises(ValueError, match="not a directory"):
        load_split("train", corpus / "missing")


@pytest.mark.parametrize("length", [1, 16, 37])
@pytest.mark.parametrize("with_state", [False, True])
def test_ouro_kda_kernel_matches_transformers_in_value_and_gradient(length, with_state):
    m = hf_model.hf_modeling()
    hf_model.use_transformers_kda()
    reference = m.chunk_kimi_delta_attention
    gen = torch.Generator().manual_seed(length)
    B, H, dk, dv = 2, 3, 16, 24
    shapes = [(B, length, H, dk), (B, length, H, dk), (B, length, H, dv)]
    base = [torch.randn(s, generator=gen) for s in shapes]
    g0 = -5 * torch.sigmoid(torch.randn(B, length, H, dk, generator=gen))
    b0 = torch.sigmoid(torch.randn(B, length, H, generator=gen))
    s0 = torch.randn(B, H, dk, dv, generator=gen) if with_state else None
    w = torch.randn(B, length, H, dv, generator=gen)

    def run(fn):
        xs = [t.clone().requires_grad_() for t in base + [g0, b0]]
        o, s = fn(*xs, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        ((o * w).sum() + s.square().sum()).backward()
        return o.detach(), s.detach(), [x.grad for x in xs]
    o1, s1, g1 = run(reference)
    hf_model.use_ouro_kda(16)
    try:
        o2, s2, g2 = run(m.chunk_kimi_delta_attention)
    finally:
        hf_model.use_transformers_kda()
    assert rel_rms(o2, o1) < 1e-5 and rel_rms(s2, s1) < 1e-5
    for a, b in zip(g2, g1):   # a gradient that is exactly 0 in theory (g at T=1, no state) is noise
        assert (a - b).norm() <= 1e-4 * max(b.norm(), 1e-2), rel_rms(a, b)


@pytest.fixture(scope="module")
def eager_model():
    """A random tiny trunk whose attention returns its probabilities (eager), MTP block included."""
    model = hf_model.build_model(PRESETS["tiny"], mtp=True, seed=3)
    model.config.text_config._attn_implementation = "eager"
    model.config._attn_implementation = "eager"
    with torch.no_grad():   # a non-trivial indexer: random gate, ape and key norm
        for _, attn in hf_model.dsa_attentions(model):
            for p in attn.indexer.parameters():
                p.normal_(0, 0.3)
    return model.eval()


def test_distillation_target_is_dense_attention_mass_per_pool(eager_model):
    """The target is checked against transformers' own attention probabilities: with every pool
    selected (dense), its eager attention weights summed per pool and averaged over heads."""
    cfg = PRESETS["tiny"]
    caps, weights = LayerInputs(eager_model), {}
    hooks = [a.register_forward_hook(lambda mod, args, out, n=n: weights.__setitem__(n, out[1]))
             for n, a in hf_model.dsa_attentions(eager_model)]
    for _, a in hf_model.dsa_attentions(eager_model):
        a.indexer.index_topk = 4096
    ids = torch.randint(20, cfg.vocab_size, (2, 45), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            hf_model.forward_with_mtp(eager_model, ids)
        for name, attn in caps.attns:
            x = caps.inputs[name]
            mass = dense_pool_mass(attn, x, cfg.index_kpool)
            probs = weights[name].float().mean(1)                       # [B, S, S]
            p = mass.shape[-1]
            ref = probs[..., : p * cfg.index_kpool].reshape(*probs.shape[:2], p, cfg.index_kpool).sum(-1)
            assert rel_rms(mass, ref) < 1e-5, name
    finally:
        for h in hooks:
            h.remove()
        caps.remove()
        for _, a in hf_model.dsa_attentions(eager_model):
            a.indexer.index_topk = cfg.index_topk


def test_indexer_scores_select_what_transformers_selects(eager_model):
    """Top-k of the differentiable pool scores = the pools transformers' indexer selects."""
    cfg = PRESETS["tiny"]
    k = cfg.index_topk // cfg.index_kpool
    caps, selected = LayerInputs(eager_model), {}
    hooks = [a.indexer.register_forward_hook(lambda mod, args, out, n=n: selected.__setitem__(n, out))
             for n, a in hf_model.dsa_attentions(eager_model)]
    ids = torch.randint(20, cfg.vocab_size, (2, 50), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            hf_model.forward_with_mtp(eager_model, ids)
            checked = 0
            for name, attn in caps.attns:
                scores = indexer_pool_scores(attn, caps.inputs[name])
                b, s, p = scores.shape
                cand = candidate_mask(s, p, cfg.index_kpool, scores.device)
                for bi in range(b):
                    for t in range(s):
                        if cand[t].sum() <= k:
                            continue
                        sc = scores[bi, t].masked_fill(~cand[t], float("-inf"))
                        mine = set(torch.sort(sc, descending=True, stable=True).indices[:k].tolist())
                        toks = selected[name][bi, t, : k * cfg.index_kpool]
                        theirs = {int(x) // cfg.index_kpool for x in toks if x >= 0}
                        assert mine == theirs, (name, bi, t)
                        checked += 1
            assert checked > 50
    finally:
        for h in hooks:
            h.remove()
        caps.remove()


def test_selection_recall_against_a_plain_loop():
    gen = torch.Generator().manual_seed(0)
    s, p, kpool, k = 30, 7, 4, 3
    target = torch.rand(2, s, p, generator=gen)
    scores = torch.rand(2, s, p, generator=gen)
    cand = candidate_mask(s, p, kpool, "cpu")[None].expand(2, -1, -1)
    recall, chance, rows = selection_recall(target, scores, cand, k)
    hits, total, ch = 0.0, 0, 0.0
    for b in range(2):
        for t in range(s):
            c = [j for j in range(p) if (j * kpool + kpool - 1) <= t]
            if len(c) <= k:
                continue
            top_t = sorted(c, key=lambda j: -target[b, t, j])[:k]
            top_s = sorted(c, key=lambda j: -scores[b, t, j])[:k]
            hits += len(set(top_t) & set(top_s)) / k
            ch += k / len(c)
            total += 1
    assert rows == total and abs(recall - hits / total) < 1e-6 and abs(chance - ch / total) < 1e-6


def small_cfg(**kw):
    from ouro.train.trainer_config import TrainConfig
    base = dict(preset="tiny", steps=4, batch_size=2, seq_len=32, warmup_steps=2, eval_every=100,
                checkpoint_every=2, max_train_bytes=60_000, eval_max_bytes=4_000, dense_warmup=0.5)
    return TrainConfig(**{**base, **kw})


def test_resume_reproduces_the_uninterrupted_run_exactly(corpus, tmp_path):
    from ouro.train.trainer import Trainer
    straight = Trainer(small_cfg(corpus=str(corpus)), tmp_path / "a", PRESETS["tiny"], progress=False)
    for _ in range(4):
        straight.train_step()
    first = Trainer(small_cfg(corpus=str(corpus)), tmp_path / "b", PRESETS["tiny"], progress=False)
    for _ in range(2):
        first.train_step()
    first.save_state()
    resumed = Trainer(small_cfg(corpus=str(corpus)), tmp_path / "b", PRESETS["tiny"], progress=False)
    assert resumed.step == 2
    for _ in range(2):
        resumed.train_step()
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="lr"):
        Trainer(small_cfg(corpus=str(corpus), lr=1e-4), tmp_path / "b", PRESETS["tiny"], progress=False)


def test_only_the_indexer_loss_trains_the_indexer_and_the_bias_balances(corpus, tmp_path):
    """The trunk's indexer forward runs under no_grad: without the distillation loss its weights
    would never move. With it they do, and the router bias moves off zero."""
    from ouro.train.trainer import Trainer

    def run(weight, out):
        t = Trainer(small_cfg(corpus=str(corpus), indexer_weight=weight, steps=3, weight_decay=0.0),  # no decay
                    tmp_path / out, PRESETS["tiny"],
                    progress=False)
        before = {n: p.detach().clone() for n, p in t.model.named_parameters() if ".indexer." in n}
        bias0 = [r.e_score_correction_bias.clone() for r in hf_model.routers(t.model)]
        for _ in range(3):
            t.train_step()
        after = dict(t.model.named_parameters())
        moved = [n for n in before if not torch.equal(before[n], after[n])]
        bias_moved = any(not torch.equal(a, r.e_score_correction_bias) for a, r in zip(bias0, hf_model.routers(t.model)))
        return moved, len(before), bias_moved
    moved, n, bias_moved = run(1.0, "on")
    assert len(moved) == n and bias_moved
    moved, n, _ = run(0.0, "off")
    assert moved == []


@pytest.mark.processes
@pytest.mark.slow
def test_smoke_training_through_the_cli_learns_and_ouro_loads_it_exactly(corpus, tmp_path):
    """A few dozen steps on a corpus slice: held-out bits/byte falls, the exported checkpoint
    (MTP layer included) loads in ouro and gives transformers' logits."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "ouro.cli", "train", "--preset", "tiny", "--output", str(out), "--corpus", str(corpus),
           "--steps", "40", "--batch-size", "4", "--seq-len", "64", "--warmup-steps", "5", "--lr", "3e-3",
           "--eval-every", "20", "--checkpoint-every", "20", "--eval-max-bytes", "8000", "--export-dtype", "float32",
           "--no-progress", "--threads", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    log = [json.loads(line) for line in (out / "train" / "log.jsonl").read_text().splitlines()]
    evals = [rec["eval"] for rec in log if "eval" in rec]
    assert len(evals) == 3 and evals[-1]["bits_per_byte"] < evals[0]["bits_per_byte"] - 0.5, evals
    losses = [rec["loss"] for rec in log if "loss" in rec]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5

    from ouro.lab.reference import tie_rule  # noqa: F401  (installed by conftest)
    from transformers import Glm5NextForConditionalGeneration
    from ouro.lab.reference.compare import compare, reference_run
    from ouro.models.loader import load_model, load_weights
    config = ModelConfig.from_hf(out)
    assert config.has_mtp
    model = load_model(out)
    ignored = load_weights(model, out)
    assert ignored["mtp"] > 20                      # the MTP layer's tensors are there and were read
    hf = Glm5NextForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(20, 500, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    c = compare(model, reference_run(hf, ids, n_decode=8))
    assert c.passes(), str(c)


@pytest.mark.processes
def test_train_cli_refuses_bad_settings(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ouro.cli", "train", "--preset", "flash", "--output", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "trainable" in r.stderr
    r = subprocess.run([sys.executable, "-m", "ouro.cli", "train", "--output", str(tmp_path), "--steps", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--steps" in r.stderr
