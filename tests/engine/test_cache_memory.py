"""The cache's memory (issue 38): the default budget is bounded (at most OURO_KV_CACHE_SPACE GiB, 4
when unset, and a fraction of what is available), the cache is allocated untouched so resident
memory follows use (`small` starts without its budget resident), a long prompt is still admitted
when it fits, the tensor-parallel ranks of an engine and the workers of `serve --disagg` share one
budget, and the start-up line says the budget, where it came from and what limits concurrency."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ouro import LLM, SamplingParams
from ouro.config import EngineConfig
from ouro.engine.memory import DEFAULT_KV_CACHE_SPACE, KV_CACHE_SPACE_ENV, cache_budget, plan_memory
from ouro.layers.context import ModelCache
from ouro.models.presets import PRESETS

GIB = 1 << 30


def rss_bytes(pid="self") -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


# ---- the default budget ----

def test_default_budget_is_capped_and_a_fraction_of_what_is_available(monkeypatch):
    monkeypatch.delenv(KV_CACHE_SPACE_ENV, raising=False)
    big = cache_budget(EngineConfig(), available=24 * GIB)       # the 24 GB machine: no longer half
    assert big.total == DEFAULT_KV_CACHE_SPACE == 4 * GIB and "cap" in big.source
    small = cache_budget(EngineConfig(memory_fraction=0.5), available=3 * GIB)
    assert small.total == int(1.5 * GIB) and "available" in small.source
    # a GPU's memory is committed when allocated: its default stays a fraction of what is free
    assert cache_budget(EngineConfig(device="cuda"), available=100 * GIB).total == 50 * GIB
    monkeypatch.setenv(KV_CACHE_SPACE_ENV, "0.25")
    assert cache_budget(EngineConfig(), available=24 * GIB).total == GIB // 4
    assert cache_budget(EngineConfig(device="cuda"), available=100 * GIB).total == GIB // 4
    # the user's budget is taken as given
    assert cache_budget(EngineConfig(max_memory=12 * GIB), available=GIB).total == 12 * GIB
    monkeypatch.setenv(KV_CACHE_SPACE_ENV, "lots")
    with pytest.raises(ValueError, match=KV_CACHE_SPACE_ENV):
        cache_budget(EngineConfig())


def test_the_plan_never_exceeds_what_max_num_seqs_sequences_of_max_model_len_use():
    c = PRESETS["small"]
    plan = plan_memory(c, 64 * GIB, 64, 4, max_model_len=8192)
    assert plan.n_pages == 4 * 8192 // 64 and plan.pages_capped and plan.total_bytes < 64 * GIB
    assert "capped at max_num_seqs x max_model_len" in plan.describe(4096)


# ---- untouched until used ----

def test_a_new_cache_is_not_resident():
    c = PRESETS["small"]
    pages = GIB // (64 * ModelCache.bytes_per_token(c))
    before = rss_bytes()
    cache = ModelCache(c, 64, pages, 64)
    grown = rss_bytes() - before
    assert cache.dsa_bytes() >= 0.9 * GIB
    assert grown < 64 << 20, f"a 1 GiB cache made {grown / 2**20:.0f} MiB resident at allocation"
    cache.latent[0, :8].fill_(1.0)         # written pages become resident; only they
    assert rss_bytes() - before < 64 << 20


def test_the_poison_switch_still_fills_a_new_cache_with_nan(monkeypatch):
    monkeypatch.setenv("OURO_POISON_CACHE", "1")
    cache = ModelCache(PRESETS["tiny"], 2, 4, 16)
    assert torch.isnan(cache.recurrent).all() and torch.isnan(cache.latent).all()


START_SMALL = """
import json, sys
from ouro import LLM
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
llm = LLM("small", **json.loads(sys.argv[1]))
e = llm.engine
weights = sum(t.numel() * t.element_size() for t in list(e.model.parameters()) + list(e.model.buffers()))
budget = getattr(getattr(e, "budget", None), "total", e.config.max_memory)
print(json.dumps({"rss": rss(), "weights": weights, "planned": e.plan.total_bytes, "budget": budget}))
"""


def start_small(**kw) -> dict:
    out = subprocess.run([sys.executable, "-c", START_SMALL, json.dumps(kw)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "OURO_POISON_CACHE": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.processes
@pytest.mark.parametrize("kw", [{"max_memory": 3 * GIB}, {}], ids=["budget-3GiB", "default"])
def test_small_starts_without_its_cache_resident(kw):
    """`LLM("small")` held ~10 GB resident on a 24 GB machine (half the free memory, zeroed at
    once); before this fix a 3 GiB budget meant weights + 3 GiB resident. Now the start-up holds
    the weights and the process, not the planned cache."""
    got = start_small(**kw)
    print(f"small {kw or 'default'}: RSS {got['rss'] / GIB:.2f} GiB, weights {got['weights'] / GIB:.2f} GiB, "
          f"cache planned {got['planned'] / GIB:.2f} GiB of a {got['budget'] / GIB:.2f} GiB budget")
    if kw:
        assert got["planned"] >= 2.5 * GIB          # a cache larger than the slack below
    # the weights, perhaps twice (a packed copy for the products), and the process: not the cache
    assert got["rss"] < 2 * got["weights"] + 1 * GIB, "the planned cache is resident at start-up"
    assert got["budget"] is not None and got["budget"] <= (kw.get("max_memory") or DEFAULT_KV_CACHE_SPACE)


# ---- long prompts, and the start-up line ----

def test_a_long_prompt_is_admitted_when_it_fits(caplog):
    """A budget of a few sequences' worth of pages: a prompt that fills nearly the whole cache is
    admitted and finishes; one past the cache's capacity is refused, naming --max-memory."""
    c = PRESETS["tiny"]
    page = 16
    per_page = page * ModelCache.bytes_per_token(c)
    budget = 4 * ModelCache.bytes_per_slot(c) + 200 * per_page        # 4 slots, 200 pages: 3,200 tokens
    with caplog.at_level("INFO", logger="ouro.engine"):
        llm = LLM("tiny", max_memory=budget, page_size=page, max_num_seqs=4, max_num_batched_tokens=512)
    e = llm.engine
    assert e.plan.n_slots == 4 and e.plan.max_tokens == 3200 < e.max_model_len
    line = next(r.getMessage() for r in caplog.records if "cache budget" in r.getMessage())
    for part in ("(--max-memory)", f"{e.plan.n_pages} pages", f"{e.plan.n_slots} KDA state slots", "limited by"):
        assert part in line, line
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    n = e.plan.max_tokens - 4
    out = llm.generate([[5 + i % 400 for i in range(n)]], params)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    assert e.pages.num_free == e.pages.num_total and e.slots.num_free == e.slots.num_total
    with pytest.raises(ValueError, match="max-memory"):
        llm.generate([[5] * (e.plan.max_tokens - 2)], params)


def test_the_default_budget_holds_a_prompt_of_the_full_context(monkeypatch):
    """The bounded default still plans room for the model's whole context (`small`: 65,536 tokens,
    the default page size and max_num_seqs) even on a machine with little memory available."""
    monkeypatch.delenv(KV_CACHE_SPACE_ENV, raising=False)
    c = PRESETS["small"]
    for available in (2 * GIB, 24 * GIB):
        b = cache_budget(EngineConfig(), available=available)
        plan = plan_memory(c, b.per_rank, 64, 64, max_model_len=c.max_position_embeddings, budget=b)
        assert plan.max_tokens >= c.max_position_embeddings, (available, plan.describe(4096))


# ---- one budget for the ranks and workers started together ----

@pytest.mark.processes
def test_tensor_parallel_ranks_share_one_budget(monkeypatch):
    """--tp 2 with a budget: rank 0 plans each rank's cache from half of it and the follower builds
    what rank 0 sent; the two caches together stay within the one budget (they took one each)."""
    from ouro.config import ModelConfig
    from ouro.engine import tp_workers
    from ouro.models.resolve import resolve_model
    from ouro.parallel.tp_shard import rank_config
    sent = []
    send = tp_workers.TPWorkers.send

    def spy(self, op, helpers=False):       # records what the followers are told, then sends it
        sent.append(op)
        return send(self, op, helpers)
    monkeypatch.setattr(tp_workers.TPWorkers, "send", spy)
    budget = 48 << 20
    llm = LLM("tiny-py", max_memory=budget, page_size=16, max_num_seqs=8, tensor_parallel_size=2, dtype="float32")
    try:
        e = llm.engine
        assert e.budget.total == budget and e.budget.ranks == 2 and "shared by 2" in e.plan.describe(256)
        cache_op = next(op for op in sent if op["op"] == "cache")
        rc = rank_config(ModelConfig.from_hf(resolve_model("tiny-py")), 2)
        follower = (cache_op["n_pages"] * cache_op["page_size"] * ModelCache.bytes_per_token(rc, torch.float32)
                    + (cache_op["n_slots"] + cache_op["n_checkpoints"]) * ModelCache.bytes_per_slot(rc))
        assert cache_op["n_pages"] == e.runner.cache.n_pages and cache_op["n_slots"] == e.runner.cache.n_slots
        assert e.plan.total_bytes + follower <= budget
        assert e.plan.total_bytes + follower > 0.9 * budget          # and they use it
        out = llm.generate(["def f(x):"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.engine.close()


def test_disagg_workers_share_one_budget():
    from ouro.cli import build_parser
    from ouro.disagg.command import shared_budget, worker_argv
    args = build_parser().parse_args(["serve", "--model", "tiny", "--disagg", "1P2D", "--max-memory", str(3 << 30)])
    shared = shared_budget(args, 3)
    for role in ("prefill", "decode"):
        argv = worker_argv(shared, role, 30000)
        assert argv[argv.index("--max-memory") + 1] == str(1 << 30)
    assert args.max_memory == 3 << 30                       # the router's own arguments are left alone
    default = build_parser().parse_args(["serve", "--model", "tiny", "--disagg", "1P1D"])
    each = shared_budget(default, 2).max_memory
    assert 0 < each <= DEFAULT_KV_CACHE_SPACE // 2
