"""Structured outputs in the engine (`SamplingParams.structured`, xgrammar) on `tiny-py`: every
constrained output parses and validates against its schema (nested objects, arrays, enums,
required and optional fields, bounded numbers, patterned strings) over several seeds and with
n > 1; regex, choice and EBNF hold; an unconstrained request batched beside constrained ones gets
the tokens it gets alone; the grammar starts after its `after` token; a grammar that does not
compile fails its request only; the bitmask touches only the constrained rows."""

import json
import re

import jsonschema
import pytest
import torch

from ouro import LLM, SamplingParams
from ouro.config import EngineConfig
from ouro.engine.llm_engine import LLMEngine
from ouro.engine.request import RequestFailed
from ouro.engine.structured import Constraint, GrammarBook, check_spec, grammar_of
from ouro.models.loader import load_model
from ouro.models.resolve import load_tokenizer, resolve_model

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 99}},
                 "required": ["name", "age"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "array_enum": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"}}, "required": ["tags", "ok"], "additionalProperties": False},
    "optional_bounds": {"type": "object", "properties": {
        "score": {"type": "integer", "minimum": -5, "maximum": 5},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "note": {"type": "string", "maxLength": 6}}, "required": ["score"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "kind": {"enum": ["a", "b", 3, None]}}, "required": ["code", "kind"], "additionalProperties": False},
    "list_of_objects": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["id"],
        "additionalProperties": False}},
}
PROMPTS = ["def parse(data):\n", "hello world", "import json\n"]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-py", max_memory=64 << 20, page_size=16)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_output_validates_against_its_schema(llm, name):
    schema = SCHEMAS[name]
    spec = {"type": "json_schema", "schema": schema}
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=160, n=2, structured=spec) for s in range(3)]
    for out in llm.generate(PROMPTS, params):
        assert len(out.outputs) == 2
        for o in out.outputs:
            assert o.finish_reason == "stop", (o.text, o.finish_reason)
            assert " " not in o.text.replace('" "', "").split('"')[0]      # compact: no free whitespace up front
            jsonschema.validate(json.loads(o.text), schema)


def test_regex_choice_and_ebnf_hold(llm):
    specs = [({"type": "regex", "regex": "[a-c]{2}-[0-9]{1,3}"}, lambda t: re.fullmatch("[a-c]{2}-[0-9]{1,3}", t)),
             ({"type": "choice", "choice": ["yes", "no", "maybe (?)"]}, lambda t: t in ("yes", "no", "maybe (?)")),
             ({"type": "grammar", "grammar": 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9]'},
              lambda t: re.fullmatch(r"\([1-9](\+[1-9])*\)", t)),
]
    for spec, ok in specs:
        for o in llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=3, max_tokens=80, structured=spec)):
            assert o.outputs[0].finish_reason == "stop" and ok(o.outputs[0].text), (spec, o.outputs[0].text)
    # any JSON object: its keys and strings are unbounded, so a weak model may run out of tokens (length)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS * 3, [SamplingParams(temperature=1.0, seed=s, max_tokens=120,
                                                          structured={"type": "json_object"}) for s in range(9)])]
    assert all(o.finish_reason == "length" or isinstance(json.loads(o.text), dict) for o in outs)
    assert any(o.finish_reason == "stop" for o in outs), [o.text for o in outs]


def test_an_unconstrained_request_beside_constrained_ones_gets_its_tokens_alone(llm):
    free = [SamplingParams(temperature=0, max_tokens=24), SamplingParams(temperature=0.9, seed=7, max_tokens=24)]
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], free)]
    spec = {"type": "json_schema", "schema": SCHEMAS["nested"]}
    mixed = llm.generate(PROMPTS[:2] + PROMPTS, free + [SamplingParams(temperature=1.0, seed=s, max_tokens=60,
                                                                       structured=spec) for s in range(3)])
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone


def test_the_grammar_starts_after_its_token():
    d = resolve_model("tiny-py")
    tok = load_tokenizer(d)
    end = tok.token_to_id("</think>")
    free = tok.encode("so:").ids
    e = LLMEngine(load_model(d), tok, EngineConfig(max_memory=64 << 20, page_size=16), verbose=False)
    e.add_request("x", SamplingParams(temperature=0, max_tokens=40, forced_prefix_ids=free + [end],
                                      structured={"type": "choice", "choice": ["alpha", "beta"], "after": end}))
    out = None
    while e.has_unfinished():
        for o in e.step():
            out = o
    assert out.token_ids[:len(free) + 1] == free + [end]           # before `after`: what the prefix forced, unchecked
    assert tok.decode(out.token_ids[len(free) + 1:]) in ("alpha", "beta") and out.finish_reason == "stop"


def _run_collecting(e):
    done, failed = {}, []
    while e.has_unfinished():
        try:
            for o in e.step():
                done[o.request_id] = o
        except RequestFailed as err:
            failed.append((err.request_id, str(err), err.status))
    return done, failed


def test_a_grammar_that_does_not_compile_fails_its_request_only():
    d = resolve_model("tiny-py")
    e = LLMEngine(load_model(d), load_tokenizer(d), EngineConfig(max_memory=64 << 20, page_size=16), verbose=False)
    e.add_request("a", SamplingParams(temperature=0, max_tokens=4), "ok")
    e.add_request("b", SamplingParams(max_tokens=4, structured={"type": "regex", "regex": "(("}), "bad")
    done, failed = _run_collecting(e)
    assert [f[0] for f in failed] == ["bad"] and "does not compile" in failed[0][1]
    assert failed[0][2] == 400                                  # the request's own fault: a server answers 400
    assert done["ok"].finished and "bad" not in e.requests
    assert e.pages.num_free == e.pages.num_total


def test_two_grammars_failing_in_one_step_each_fail_their_request():
    d = resolve_model("tiny-py")
    e = LLMEngine(load_model(d), load_tokenizer(d), EngineConfig(max_memory=64 << 20, page_size=16), verbose=False)
    e.add_request("a", SamplingParams(temperature=0, max_tokens=4), "ok")
    for rid in ("b", "c"):
        e.add_request("bad", SamplingParams(max_tokens=4, structured={"type": "regex", "regex": "(("}), rid)
    done, failed = _run_collecting(e)
    assert sorted(f[0] for f in failed) == ["b", "c"] and done["ok"].finished
    assert e.pages.num_free == e.pages.num_total


def test_constraints_that_leave_no_token_fail_that_request_only():
    """A forced prefix that goes on past the grammar's `after` token into ids the grammar refuses
    leaves a row with nothing to sample: that request fails (released), its neighbours' tokens are
    what they get alone, and nothing is sampled from an all -inf row (which would be NaN)."""
    d = resolve_model("tiny-py")
    tok = load_tokenizer(d)
    end = tok.token_to_id("</think>")
    bad = tok.encode("zzz").ids
    mk = lambda: LLMEngine(load_model(d), tok, EngineConfig(max_memory=64 << 20, page_size=16), verbose=False)
    alone = mk()
    alone.add_request("def f(", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), "a")
    want = _run_collecting(alone)[0]["a"].token_ids
    e = mk()
    e.add_request("def f(", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), "a")
    e.add_request("so", SamplingParams(temperature=0, max_tokens=8, forced_prefix_ids=[end] + bad,
                                       structured={"type": "choice", "choice": ["alpha"], "after": end}), "x")
    done, failed = _run_collecting(e)
    assert [f[0] for f in failed] == ["x"] and "no token" in failed[0][1] and failed[0][2] == 400
    assert done["a"].token_ids == want
    assert e.pages.num_free == e.pages.num_total and "x" not in e.requests


def test_the_bitmask_touches_only_active_constrained_rows():
    d = resolve_model("tiny-py")
    from ouro.config import ModelConfig
    c = ModelConfig.from_hf(d)
    book = GrammarBook(load_tokenizer(d), c.vocab_size, c.eos_token_ids)
    g = book.compile({"type": "choice", "choice": ["yes", "no"]})
    logits = torch.randn(4, c.vocab_size, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    waiting = Constraint(g, after=5)                    # not active yet: left alone
    book.mask(logits, [None, Constraint(g), waiting, None])
    assert torch.equal(logits[[0, 2, 3]], before[[0, 2, 3]])
    kept = (logits[1] > float("-inf")).nonzero().flatten()
    assert 0 < len(kept) < 10 and torch.equal(logits[1, kept], before[1, kept])


@pytest.mark.parametrize("spec, says", [({"type": "regex"}, "does not compile"), ({"type": "nope"}, "type one of"),
                                        ({"type": "choice", "choice": []}, "non-empty"),
                                        ({"type": "json_schema", "schema": {"description": "x" * 70000}}, "over the limit")])
def test_bad_specs_are_named(spec, says):
    d = resolve_model("tiny-py")
    from ouro.config import ModelConfig
    c = ModelConfig.from_hf(d)
    with pytest.raises(ValueError, match=says):
        check_spec(spec)
        GrammarBook(load_tokenizer(d), c.vocab_size, c.eos_token_ids).compile(spec)


def test_the_timeline_shows_mask_time_in_its_own_category(llm):
    from ouro.lab.timeline.analysis import exclusive_times
    from ouro.measure import spans
    spans.clear()
    spans.enable()
    try:
        llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=12),
                               SamplingParams(temperature=0, max_tokens=40, structured={"type": "json_object"}),
                               SamplingParams(temperature=0, max_tokens=12)])
    finally:
        spans.disable()
    events = [dict(e, pid=0, end_ms=e["start_ms"] + e["dur_ms"]) for e in spans.events()]
    masks = [e for e in events if e["cat"] == "mask"]
    assert masks and all(e["name"] == "grammar mask" for e in masks)
    assert exclusive_times(events).get("mask", 0) > 0


def test_with_speculation_the_grammar_checks_the_drafts():
    """NEXTN drafts for constrained rows: a draft the grammar rejects is never emitted, greedy
    output equals the non-speculative engine's, and drafts were verified for those rows."""
    spec = {"type": "json_schema", "schema": SCHEMAS["nested"]}
    plain = LLM("tiny-py", max_memory=64 << 20, page_size=16)
    fast = LLM("tiny-py", max_memory=64 << 20, page_size=16,
               speculative_config={"method": "nextn", "num_speculative_tokens": 3})
    params = [SamplingParams(temperature=0, max_tokens=120, structured=spec)] * 2 + [
        SamplingParams(temperature=1.0, seed=s, max_tokens=120, structured=spec) for s in range(2)]
    want = [o.outputs[0].text for o in plain.generate(PROMPTS[:2] * 2, params)]
    got = fast.generate(PROMPTS[:2] * 2, params)
    assert [o.outputs[0].text for o in got[:2]] == want[:2]           # greedy: the same tokens
    for o in got:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMAS["nested"])
    stats = fast.engine.speculator.stats
    assert stats.steps > 0 and stats.proposed > 0


def test_a_slow_compile_holds_its_request_not_the_batch(monkeypatch):
    import threading
    gate, real = threading.Event(), GrammarBook.compile
    monkeypatch.setattr(GrammarBook, "compile", lambda self, spec: (gate.wait(30), real(self, spec))[1])
    d = resolve_model("tiny-py")
    e = LLMEngine(load_model(d), load_tokenizer(d), EngineConfig(max_memory=64 << 20, page_size=16), verbose=False)
    e.add_request("x", SamplingParams(max_tokens=40, structured={"type": "choice", "choice": ["a", "b"]}), "held")
    e.add_request("y", SamplingParams(temperature=0, max_tokens=6), "free")
    seen = {}
    while "free" not in seen or not seen["free"].finished:
        for o in e.step():
            seen[o.request_id] = o
    assert "held" not in seen and len(e.grammars) == 1        # the batch ran on while the grammar compiled
    gate.set()
    while e.has_unfinished():
        for o in e.step():
            seen[o.request_id] = o
    assert seen["held"].finished and seen["held"].text in ("a", "b")


SPECS = [{"type": "json_schema", "schema": SCHEMAS["nested"]}, {"type": "json_object"},
         {"type": "regex", "regex": "[a-c]{2,4}x"}, {"type": "choice", "choice": ["alpha", "be.ta"]},
         {"type": "grammar", "grammar": 'root ::= "yes" | "no" [0-9]*'},
         {"type": "structural_tag", "tag": {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}}]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s["type"])
def test_the_grammar_built_without_the_vocabulary_compiles_to_the_direct_compile(spec):
    """`grammar_of` (the server's check, and the compile's input) gives what xgrammar's direct
    compile of the same spec gives: the same allowed tokens along a walk of the grammar."""
    import xgrammar as xg
    d = resolve_model("tiny-py")
    from ouro.config import ModelConfig
    c = ModelConfig.from_hf(d)
    book = GrammarBook(load_tokenizer(d), c.vocab_size, c.eos_token_ids)
    via = book.compile(spec)
    kind = spec["type"]
    direct = {"json_schema": lambda: book.compiler.compile_json_schema(json.dumps(spec["schema"]), any_whitespace=False,
                                                                        separators=(",", ":"), strict_mode=True),
              "json_object": lambda: book.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                                        separators=(",", ":"), strict_mode=True),
              "regex": lambda: book.compiler.compile_regex(spec["regex"]),
              "choice": lambda: book.compiler.compile_regex("alpha|be\\.ta"),
              "grammar": lambda: book.compiler.compile_grammar(spec["grammar"]),
              "structural_tag": lambda: book.compiler.compile_structural_tag(json.dumps(spec["tag"]))}[kind]()
    a, b = xg.GrammarMatcher(via), xg.GrammarMatcher(direct)
    ma, mb = (xg.allocate_token_bitmask(1, c.vocab_size) for _ in range(2))
    steps = 0
    while not a.is_terminated() and steps < 12:
        a.fill_next_token_bitmask(ma)
        b.fill_next_token_bitmask(mb)
        assert torch.equal(ma, mb)
        ok = [t for t in range(c.vocab_size) if (ma[0, t // 32] >> (t % 32)) & 1]
        go = [t for t in ok if t not in c.eos_token_ids] or ok        # walk on while the grammar allows
        assert go and a.accept_token(go[steps % len(go)]) and b.accept_token(go[steps % len(go)])
        steps += 1
    assert steps > 0 and a.is_terminated() == b.is_terminated()


def test_a_compile_that_fails_only_against_the_vocabulary_is_a_400_from_the_engine(monkeypatch):
    """The server checks a spec by building its grammar (no vocabulary); should the engine's compile
    still fail, that request alone fails with status 400."""
    def broken(self, grammar, **kw):
        raise RuntimeError("[12:00:00] /x/compiler.cc:1: out of tokens")
    import xgrammar as xg
    monkeypatch.setattr(xg.GrammarCompiler, "compile_grammar", broken)
    d = resolve_model("tiny-py")
    e = LLMEngine(load_model(d), load_tokenizer(d), EngineConfig(max_memory=64 << 20, page_size=16), verbose=False)
    e.add_request("a", SamplingParams(temperature=0, max_tokens=4), "ok")
    e.add_request("b", SamplingParams(max_tokens=4, structured={"type": "regex", "regex": "ab"}), "bad")
    done, failed = _run_collecting(e)
    assert failed == [("bad", "the regex does not compile: out of tokens", 400)] and done["ok"].finished


def test_each_request_grammar_compiles_once(llm, monkeypatch):
    calls, real = [], GrammarBook.compile
    monkeypatch.setattr(GrammarBook, "compile", lambda self, spec: (calls.append(spec["type"]), real(self, spec))[1])
    llm.generate(PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=8, structured={"type": "json_object"}),
                               SamplingParams(temperature=0, max_tokens=8)])
    assert calls == ["json_object"]


@pytest.mark.parametrize("spec, says", [({"type": "regex", "regex": "(("}, "does not compile"),
                                        ({"type": "grammar", "grammar": "root ::= foo"}, "foo"),
                                        ({"type": "json_schema", "schema": {"type": "objekt"}}, "objekt"),
                                        ({"type": "structural_tag", "tag": {"x": 1}}, "format")])
def test_grammar_of_names_what_does_not_build(spec, says):
    with pytest.raises(ValueError, match=says):
        grammar_of(spec)
