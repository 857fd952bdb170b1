"""Structured outputs: a request's output held to a grammar, with xgrammar (the library vLLM and
SGLang use; ouro writes no grammar engine).

A request's `SamplingParams.structured` names the grammar: {"type": "json_schema", "schema": ...},
{"type": "json_object"}, {"type": "regex", "regex": ...}, {"type": "choice", "choice": [...]},
{"type": "grammar", "grammar": EBNF} or {"type": "structural_tag", "tag": ...} (strict tool calls),
plus "after": a token id (GLM's `</think>`) before which the output is free, so a reasoning
section stays unconstrained and the grammar starts after it. JSON is compact (no free
whitespace, as vLLM's `disable-any-whitespace`), so a weak model cannot spend its budget on blanks.

`grammar_of` builds a spec's grammar without the vocabulary (the server's check: a spec that does
not build is a 400 before the engine sees it). `GrammarBook` compiles it against the vocabulary, in
the engine only (once per grammar: xgrammar's compiler cache, bounded in bytes) on a
thread of its own, so the engine's step never waits on a compile: a request waits until its
grammar is ready (`LLMEngine`). `Constraint` is one request's matcher: each step the constrained
rows' token bitmasks are filled and applied to those rows only (`mask`), an unconstrained row of
the same batch is left as it is; each sampled token is accepted; a finished grammar ends the request.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future, ThreadPoolExecutor

import torch

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_GRAMMAR_BYTES = 64 << 10       # a schema / regex / grammar larger than this is refused
CACHE_BYTES = 64 << 20             # compiled grammars kept (xgrammar's cache, least recently used out)


def check_spec(spec) -> None:
    """A `structured` spec's shape; ValueError naming what is wrong (the compile checks the rest)."""
    if not isinstance(spec, dict) or spec.get("type") not in KINDS:
        raise ValueError(f"structured must be a dict with type one of {', '.join(KINDS)}, got {spec!r}"[:300])
    body = {k: v for k, v in spec.items() if k not in ("type", "after")}
    size = len(json.dumps(body, default=str))
    if size > MAX_GRAMMAR_BYTES:
        raise ValueError(f"the {spec['type']} is {size} bytes, over the limit of {MAX_GRAMMAR_BYTES}")
    if spec["type"] == "choice" and not (isinstance(spec.get("choice"), list) and spec["choice"]
                                         and all(isinstance(c, str) for c in spec["choice"])):
        raise ValueError("a choice constraint needs a non-empty list of strings")
    if spec.get("after") is not None and not (isinstance(spec["after"], int) and spec["after"] >= 0):
        raise ValueError(f"structured.after must be a token id, got {spec['after']!r}")


def tokenizer_info(tokenizer, vocab_size: int, stop_ids):
    """xgrammar's view of a `tokenizers.Tokenizer` (no transformers needed): every id's token
    string, the vocabulary's encoding (byte-level, ...) read from the tokenizer's own JSON."""
    import xgrammar as xg
    meta = xg.TokenizerInfo._detect_metadata_from_hf(tokenizer.to_str())
    encoded = [""] * vocab_size
    for text, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            encoded[i] = text
    return xg.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size, stop_token_ids=list(stop_ids),
                            add_prefix_space=meta["add_prefix_space"])


def grammar_of(spec: dict):
    """The grammar `spec` names, built without a tokenizer (a millisecond where the compile against
    the vocabulary may take a second): the server's 400 check, and the compile's input. ValueError
    naming the problem."""
    import xgrammar as xg
    check_spec(spec)
    kind = spec["type"]
    try:
        if kind in ("json_schema", "json_object"):     # json_object: OpenAI's "any JSON object"
            schema = spec["schema"] if kind == "json_schema" else {"type": "object"}
            return xg.Grammar.from_json_schema(schema if isinstance(schema, str) else json.dumps(schema),
                                               any_whitespace=False, separators=(",", ":"), strict_mode=True)
        if kind == "regex":
            return xg.Grammar.from_regex(spec["regex"])
        if kind == "choice":
            return xg.Grammar.from_regex("|".join(_regex_literal(x) for x in spec["choice"]))
        if kind == "grammar":
            return xg.Grammar.from_ebnf(spec["grammar"])
        tag = spec["tag"]
        return xg.Grammar.from_structural_tag(tag if isinstance(tag, str) else json.dumps(tag))
    except (RuntimeError, ValueError, TypeError, KeyError) as e:
        raise _not_compiled(kind, e) from None


def _not_compiled(kind: str, e: Exception) -> ValueError:
    """xgrammar's complaint about a `kind` spec, without its '[time] file.cc:line:' prefix."""
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    why = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", first)
    return ValueError(f"the {kind} does not compile: {why}"[:500])


class GrammarBook:
    def __init__(self, tokenizer, vocab_size: int, stop_ids, cache_bytes: int = CACHE_BYTES, threads: int = 1):
        import xgrammar as xg
        self.xg, self.vocab_size = xg, vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size, stop_ids)
        self.compiler = xg.GrammarCompiler(self.info, max_threads=threads, cache_limit_bytes=cache_bytes)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="ouro-grammar")
        self.bitmask = None

    def compile(self, spec: dict):
        """The compiled grammar of `spec`; ValueError naming the problem when it does not compile."""
        grammar = grammar_of(spec)
        try:
            return self.compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise _not_compiled(spec["type"], e) from None

    def submit(self, spec: dict) -> Future:
        """Compile on the book's thread (the caller's step goes on)."""
        return self.pool.submit(self.compile, spec)

    def mask(self, logits: torch.Tensor, constraints: list) -> None:
        """Fill and apply the bitmasks of the rows whose constraint is active (None: a free row)."""
        rows = [k for k, c in enumerate(constraints) if c is not None and c.active]
        if not rows:
            return
        n = logits.shape[0]
        if self.bitmask is None or self.bitmask.shape[0] < n:
            self.bitmask = self.xg.allocate_token_bitmask(max(n, 16), self.vocab_size)
        for k in rows:
            constraints[k].matcher.fill_next_token_bitmask(self.bitmask, k)
        self.xg.apply_token_bitmask_inplace(logits, self.bitmask[:n].to(logits.device), vocab_size=self.vocab_size,
                                            indices=rows)

    def mask_drafts(self, c, drafts: list[int], logits: torch.Tensor) -> list[int]:
        """Speculative verification of a constrained row: the drafts up to the first one its grammar
        rejects, and the target's logits [1 + drafts, V] masked position by position with the
        grammar's state after the drafts before it; the matcher is rolled back where it was (the
        emitted tokens are accepted one by one afterwards)."""
        m, ok = c.matcher, 0
        for d in drafts:
            if m.is_terminated() or not m.accept_token(d):
                break
            ok += 1
        m.rollback(ok)
        bitmask = self.xg.allocate_token_bitmask(ok + 1, self.vocab_size)
        for i in range(ok + 1):
            m.fill_next_token_bitmask(bitmask, i)
            if i < ok:
                m.accept_token(drafts[i])
        m.rollback(ok)
        self.xg.apply_token_bitmask_inplace(logits[: ok + 1], bitmask.to(logits.device), vocab_size=self.vocab_size)
        return drafts[:ok]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _regex_literal(text: str) -> str:
    return "".join("\\" + ch if ch in r".^$*+?{}[]\|()" else ch for ch in text)


class Constraint:
    """One request's matcher. `after`: the token that opens the constrained part (none: at once)."""

    def __init__(self, compiled, after: int | None = None):
        import xgrammar as xg
        self.matcher = xg.GrammarMatcher(compiled)
        self.after, self.active, self.violated = after, after is None, False

    def accept(self, tok: int) -> None:
        if not self.active:
            self.active = tok == self.after
            return
        if not self.matcher.accept_token(tok):
            self.violated = True           # only a forced token can do this: the request ends

    @property
    def done(self) -> bool:
        return self.violated or (self.active and self.matcher.is_terminated())
