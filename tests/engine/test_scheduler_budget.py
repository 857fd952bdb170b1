"""The scheduler's token budget: whole prompts where a step can take them, chunks where it cannot.

A prompt that fits a whole step is not cut to fill the leftover budget of a step that already has
work (its first token would wait a step for the tail); a prompt longer than the budget is still
chunked, and a step with nothing else always takes the first waiting prompt."""

from __future__ import annotations

import pytest

from ouro.engine.page_pool import PagePool, SlotPool
from ouro.engine.request import Request, Status
from ouro.engine.sampling import SamplingParams
from ouro.engine.scheduler import Scheduler


def scheduler(budget: int, seqs: int = 8, chunk_align: int = 0) -> Scheduler:
    return Scheduler(PagePool(256), SlotPool(seqs), page_size=16, max_num_seqs=seqs, max_num_batched_tokens=budget,
                     chunk_align=chunk_align)


def request(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4))


def run_step(s: Scheduler) -> dict[str, int]:
    """Schedule one step and account it as the engine does (a finished prefill samples a token)."""
    batch = s.schedule()
    for r, n in zip(batch.requests, batch.num_new_tokens):
        r.num_computed += n
        if r.num_computed == r.num_tokens:
            r.output_ids.append(7)
    return {r.request_id: n for r, n in zip(batch.requests, batch.num_new_tokens)}


@pytest.mark.parametrize("budget", [130, 200, 255])
def test_a_prompt_a_step_could_take_whole_waits_rather_than_being_cut(budget):
    s = scheduler(budget)
    for i in range(3):
        s.add(request(f"p{i}", 128))
    first = run_step(s)
    assert first == {"p0": 128}            # p1 would only fit as a cut (2..127 tokens): it waits
    assert [r.request_id for r in s.waiting] == ["p1", "p2"]
    second = run_step(s)
    assert second == {"p0": 1, "p1": 128}  # p0 decodes beside the next whole prompt
    third = run_step(s)
    assert third == {"p0": 1, "p1": 1, "p2": 128}
    assert all(r.status is Status.RUNNING for r in s.running)


def test_prompts_that_fit_together_share_a_step():
    s = scheduler(256)
    for i in range(3):
        s.add(request(f"p{i}", 128))
    assert run_step(s) == {"p0": 128, "p1": 128}
    assert run_step(s) == {"p0": 1, "p1": 1, "p2": 128}     # 254 left beside two decode rows: p2 fits whole


def test_the_rule_never_holds_back_a_prompt_that_fits():
    s = scheduler(256)
    for i in range(3):
        s.add(request(f"p{i}", 100))
    assert run_step(s) == {"p0": 100, "p1": 100}    # 56 left: p2 (100) waits whole
    assert run_step(s) == {"p0": 1, "p1": 1, "p2": 100}


def test_a_prompt_longer_than_the_budget_is_still_chunked():
    s = scheduler(128)
    s.add(request("short", 40))
    s.add(request("long", 300))
    assert run_step(s) == {"short": 40, "long": 88}     # longer than any step: cut to fill this one
    assert run_step(s) == {"short": 1, "long": 127}
    assert run_step(s) == {"short": 1, "long": 85}


def test_a_step_with_nothing_else_takes_the_first_prompt():
    s = scheduler(64)
    s.add(request("a", 200))
    assert run_step(s) == {"a": 64}
    assert run_step(s) == {"a": 64}


def test_a_cut_at_a_checkpoint_boundary_still_admits_beside_running_requests():
    """Prefix caching ends prefill chunks on checkpoint boundaries (`chunk_align`): that cut is no
    leftover-budget cut, so a prompt is admitted beside running decode rows, never starved by them."""
    s = scheduler(512, chunk_align=64)
    s.add(request("a", 100))
    assert run_step(s) == {"a": 64}                 # to the last boundary, then the rest
    s.add(request("b", 200))
    assert run_step(s) == {"a": 36, "b": 192}       # b too: cut at its own last boundary
    assert run_step(s) == {"a": 1, "b": 8}


def test_a_prompt_the_next_step_could_not_take_whole_is_cut_now():
    """Beside running requests a step never has its whole budget: a prompt longer than the budget
    less a row for each of them is cut to fill this step, not held for a whole step that never comes."""
    s = scheduler(136, seqs=16)
    for i in range(7):
        s.add(request(f"r{i}", 16))
    assert run_step(s) == {f"r{i}": 16 for i in range(7)}
    s.add(request("p", 130))
    s.add(request("q", 120))
    assert run_step(s) == {**{f"r{i}": 1 for i in range(7)}, "p": 129}     # 136 - 7 < 130: cut, as before
    assert run_step(s) == {**{f"r{i}": 1 for i in range(7)}, "p": 1, "q": 120}   # 128 left: q whole


def test_drafted_rows_count_against_the_next_step():
    """Running requests that verify drafts take 1 + K tokens a step: a prompt the next step could not
    take whole beside them is cut now, not held for as long as they run."""
    s = scheduler(64, seqs=16)
    for i in range(4):
        s.add(request(f"r{i}", 8))
    assert run_step(s) == {f"r{i}": 8 for i in range(4)}
    for i in range(4):
        s.running[i].draft_ids = [5, 5, 5]          # each verifies 3 drafts next: 4 tokens a step
    s.add(request("p", 56))
    assert run_step(s) == {**{f"r{i}": 4 for i in range(4)}, "p": 48}    # 64 - 16 < 56: cut, as before
