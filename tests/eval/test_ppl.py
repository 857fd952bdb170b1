"""Prompt logprobs in the engine (vLLM semantics) and held-out bits/byte (`ouro eval ppl`)
against transformers and a naive recomputation with ouro's model."""

import json
import math
import random
import subprocess
import sys

import pytest
import torch

from tests.helpers.numerics import rel_rms
from ouro.cli import main as ouro_main
from ouro.config import EngineConfig
from ouro.engine.llm import LLM
from ouro.engine.llm_engine import LLMEngine
from ouro.engine.sampling import SamplingParams
from ouro.engine.simple_runner import SimpleRunner
from ouro.eval.corpus import is_held_out, load_split
from ouro.eval.ppl import evaluate_bits_per_byte, transformers_bits_per_byte
from ouro.models.loader import load_model
from ouro.models.resolve import load_tokenizer
from tests.helpers.engine_drive import budget_for, drive, hf_greedy, pools_full

CONTEXT = 64
TEXTS = [
    'def add(a, b):\n    """Return a + b."""\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n'
    '        self.x, self.y = x, y\n\n    def __repr__(self):\n        return f"Point({self.x}, {self.y})"\n' * 2,
    '# café, naïve, 3 → 4: non-ASCII bytes count as bytes, not characters\nimport os\nimport sys\n\n'
    'for name in sorted(os.listdir(".")):\n    if name.endswith(".py"):\n        print(name, file=sys.stderr)\n' * 2,
    'VALUES = {"alpha": 1, "beta": 2, "gamma": 3}\n\n\ndef total(values=VALUES):\n    s = 0\n'
    '    for key, value in values.items():\n        s += value * len(key)\n    return s\n',
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three held-out files and one train file (which the held-out split must leave out)."""
    d = tmp_path_factory.mktemp("ppl_corpus")
    held = [f"mod_{i}.py" for i in range(1000) if is_held_out(f"mod_{i}.py")][:len(TEXTS)]
    train = next(f"mod_{i}.py" for i in range(1000) if not is_held_out(f"mod_{i}.py"))
    for name, text in zip(held, TEXTS):
        (d / name).write_text(text, encoding="utf-8")
    (d / train).write_text("print('train only')\n", encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def hf(tiny_checkpoint):
    from transformers import Glm5NextForConditionalGeneration
    return Glm5NextForConditionalGeneration.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint)


def prompts(n_list, seed=0, vocab=512):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in n_list]


def engine_for(model, batched=16, caching=False, pages=120, slots=8):
    cfg = EngineConfig(page_size=16, max_memory=budget_for(model.config, pages=pages, slots=slots),
                       max_num_seqs=4, max_num_batched_tokens=batched, enable_prefix_caching=caching)
    engine = LLMEngine(model, None, cfg, verbose=False)
    engine.runner.cache.poison()      # NaN cache: a read of never-written state shows up in the logprobs
    return engine


def actual(plp, ids) -> torch.Tensor:
    """The logprob of each prompt token 1.. from a prompt_logprobs list."""
    assert len(plp) == len(ids) and plp[0] is None
    return torch.tensor([plp[i][ids[i]] for i in range(1, len(ids))], dtype=torch.float64)


def hf_logp(hf, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_prompt_logprobs_match_transformers(model, hf):
    """A prompt longer than the 16-token prefill chunk and a second asking prompt, batched with
    requests that do not ask: every entry equals transformers' log_softmax at position i - 1."""
    asks = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    long_p, short_p, other1, other2 = prompts([70, 23, 9, 40])
    engine = engine_for(model)
    rids = [engine.add_request(p, sp) for p, sp in [(other1, plain), (long_p, asks), (other2, plain), (short_p, asks)]]
    out = drive(engine)
    for rid, ids in [(rids[1], long_p), (rids[3], short_p)]:
        plp = out[rid].prompt_logprobs
        assert all(len(e) == 1 and not math.isnan(next(iter(e.values()))) for e in plp[1:])   # k=0: the token only
        ref = hf_logp(hf, ids)
        theirs = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert rel_rms(actual(plp, ids), theirs) < 1e-5
    for rid, ids in [(rids[0], other1), (rids[2], other2)]:     # rows that did not ask: unchanged
        assert out[rid].prompt_logprobs is None
        assert out[rid].token_ids == hf_greedy(hf, ids, 3)[0]
    assert pools_full(engine)


def test_prompt_logprobs_survive_preemption(model):
    """Two asking requests whose decodes outgrow the page pool: the one preempted and recomputed
    keeps entries equal to a solo run's (and the other's are unaffected)."""
    asks = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=0)
    a, b = prompts([60, 60], seed=3)
    engine = engine_for(model, batched=48, pages=8, slots=2)
    assert engine.pages.num_total < 12                   # two requests of 6 pages each do not fit
    ra, rb = engine.add_request(a, asks), engine.add_request(b, asks)
    out = drive(engine)
    assert engine.scheduler.num_preemptions > 0, "the page budget was meant to force preemption"
    solo = engine_for(model, batched=48)
    for rid, ids in [(ra, a), (rb, b)]:
        rs = solo.add_request(ids, asks)
        assert rel_rms(actual(out[rid].prompt_logprobs, ids), actual(drive(solo)[rs].prompt_logprobs, ids)) < 1e-6
    assert pools_full(engine)


def test_prompt_logprobs_skip_prefix_cache(model):
    """A second identical prompt asking for prompt logprobs takes no prefix hit and gets the same
    entries; one that does not ask still hits the prefix the asking requests cached."""
    ids = prompts([50], seed=1)[0]
    asks = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    engine = engine_for(model, batched=32, caching=True)
    def run(params):
        rid = engine.add_request(ids, params)
        return drive(engine)[rid]
    first, second = run(asks), run(asks)
    assert second.cached_tokens == 0
    assert actual(second.prompt_logprobs, ids).tolist() == actual(first.prompt_logprobs, ids).tolist()
    plain = run(SamplingParams(temperature=0, max_tokens=1))
    assert plain.cached_tokens > 0 and plain.prompt_logprobs is None


def test_prompt_logprobs_top_k_through_llm_generate(tiny_checkpoint, model):
    """`LLM.generate` with prompt_logprobs=3: each entry holds the actual token and the 3 largest
    logprobs of the full distribution (ouro's model run directly)."""
    ids = prompts([30], seed=2)[0]
    llm = LLM(str(tiny_checkpoint), max_memory=64 << 20, page_size=16)
    res = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3))[0]
    plp = res.prompt_logprobs
    full = SimpleRunner(model, 1, len(ids)).step([ids], logits="all").float().log_softmax(-1)
    for i in range(1, len(ids)):
        vals, top = full[i - 1].topk(3)
        entry = plp[i]
        assert set(entry) == set(top.tolist()) | {ids[i]}
        assert torch.allclose(torch.tensor([entry[t] for t in top.tolist()]), vals, atol=1e-5)
        assert abs(entry[ids[i]] - float(full[i - 1, ids[i]])) < 1e-5


@pytest.mark.parametrize("caching", [False, True])
def test_max_tokens_zero_prefills_and_scores_only(model, caching):
    """max_tokens 0 (what a server's echo-only scoring asks): the prompt is prefilled in chunks,
    its logprobs and ranks filled, no token sampled, finish_reason "length", the pages and slot
    returned; requests batched beside it keep their tokens. Each rank is 1 + the tokens with a
    greater logprob in ouro's model run directly (within the engine's 1e-5 of it)."""
    long_p, short_p, other = prompts([45, 12, 20], seed=5)
    score = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=2)
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine = engine_for(model, caching=caching)
    rids = [engine.add_request(p, sp) for p, sp in [(long_p, score), (other, plain), (short_p, score),
                                                     (short_p, SamplingParams(max_tokens=0))]]
    out = drive(engine)
    engine.reset_prefix_cache()        # the cached prompt pages (caching) are the cache's, not held
    assert pools_full(engine) and not engine.requests
    for rid, ids in [(rids[0], long_p), (rids[2], short_p)]:
        o = out[rid]
        assert o.token_ids == [] and o.finish_reason == "length" and o.text == ""
        full = SimpleRunner(model, 1, len(ids)).step([ids], logits="all").float().log_softmax(-1)
        assert o.prompt_ranks[0] is None and o.prompt_logprobs[0] is None
        for i in range(1, len(ids)):
            row, lp, rank = full[i - 1], o.prompt_logprobs[i][ids[i]], o.prompt_ranks[i]
            assert abs(lp - float(row[ids[i]])) < 1e-5 and len(o.prompt_logprobs[i]) in (2, 3)
            assert 1 + int((row > lp + 1e-5).sum()) <= rank <= 1 + int((row > lp - 1e-5).sum())
    assert out[rids[3]].token_ids == [] and out[rids[3]].prompt_logprobs is None
    solo = engine_for(model)
    rs = solo.add_request(other, plain)
    assert out[rids[1]].token_ids == drive(solo)[rs].token_ids and len(out[rids[1]].token_ids) == 4


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True, 10_000])
def test_prompt_logprobs_misuse(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def naive_bits(model, tok, docs, L):
    """One forward per window with ouro's model: bits, predicted tokens, windows."""
    nats, n_tok, n_win = 0.0, 0, 0
    for d in docs:
        s = [0] + tok.encode(d.text, add_special_tokens=False).ids
        n_tok += len(s) - 1
        for j in range(0, len(s) - 1, L):
            w = s[j:j + L + 1]
            logp = SimpleRunner(model, 1, len(w)).step([w], logits="all").double().log_softmax(-1)
            nats -= float(logp[torch.arange(len(w) - 1), torch.tensor(w[1:])].sum())
            n_win += 1
    return nats / math.log(2), n_tok, n_win


@pytest.fixture(scope="module")
def ppl(tiny_checkpoint, corpus):
    llm = LLM(str(tiny_checkpoint), max_memory=64 << 20, page_size=16, max_num_batched_tokens=128)
    docs = load_split("held_out", corpus)
    return llm, docs, evaluate_bits_per_byte(llm, llm.engine.tokenizer, docs, CONTEXT, progress=False)


def test_bits_per_byte_matches_transformers_and_naive(tiny_checkpoint, model, ppl):
    llm, docs, r = ppl
    tok = load_tokenizer(tiny_checkpoint)
    assert sorted(d.text for d in docs) == sorted(TEXTS)               # the train file is left out
    bits, n_tok, n_win = naive_bits(model, tok, docs, CONTEXT)
    assert n_tok > 2 * CONTEXT and n_win > len(docs)                  # windows are really cut
    assert r.n_bytes == sum(len(t.encode("utf-8")) for t in TEXTS) > sum(len(t) for t in TEXTS)
    assert (r.n_tokens, r.n_windows, r.n_documents) == (n_tok, n_win, len(TEXTS))
    assert abs(r.nll_bits - bits) / bits < 1e-5
    assert r.bits_per_byte == pytest.approx(bits / r.n_bytes, rel=1e-5)
    t = transformers_bits_per_byte(tiny_checkpoint, tok, docs, CONTEXT, "float32")
    assert (t.n_tokens, t.n_windows, t.n_bytes) == (r.n_tokens, r.n_windows, r.n_bytes)
    assert abs(r.bits_per_byte - t.bits_per_byte) / t.bits_per_byte < 1e-5
    assert not llm.engine.has_unfinished() and pools_full(llm.engine)
    with pytest.raises(ValueError, match="context_len"):
        evaluate_bits_per_byte(llm, None, docs, 0, progress=False)


@pytest.mark.processes
def test_cli_json_matches_in_process(tiny_checkpoint, corpus, ppl):
    proc = subprocess.run([sys.executable, "-m", "ouro.cli", "eval", "ppl", "--model", str(tiny_checkpoint),
                           "--corpus", str(corpus), "--context-len", str(CONTEXT), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    r = ppl[2]
    assert got["ouro"]["bits_per_byte"] == pytest.approx(r.bits_per_byte, rel=1e-6)
    assert (got["ouro"]["n_tokens"], got["ouro"]["n_bytes"], got["ouro"]["n_windows"]) == \
        (r.n_tokens, r.n_bytes, r.n_windows)


def test_cli_text_compare_and_errors(tiny_checkpoint, corpus, ppl, capsys, tmp_path):
    args = ["eval", "ppl", "--model", str(tiny_checkpoint), "--corpus", str(corpus), "--context-len", str(CONTEXT)]
    assert ouro_main(args + ["--compare-transformers"]) == 0
    out = capsys.readouterr().out
    assert f"held-out bits/byte {ppl[2].bits_per_byte:.4f} (ouro, float32; 3 files, {ppl[2].n_bytes:,} bytes" in out
    assert "(transformers, float32" in out and "ouro - transformers" in out
    missing = tmp_path / "no_such_corpus"
    assert ouro_main(["eval", "ppl", "--model", str(tiny_checkpoint), "--corpus", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err
    assert ouro_main(["eval", "ppl", "--model", str(tmp_path / "no_model"), "--corpus", str(corpus)]) == 2
    assert "no_model" in capsys.readouterr().err
