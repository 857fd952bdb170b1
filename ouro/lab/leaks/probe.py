"""`ouro probe leaks`: drives one request down each path it can take through the engine
(finished, aborted while waiting, in prefill, in decode, preempted, a prefix-cache hit, prompt
logprobs) and checks that the path hands back every page, KDA state slot, prefix-cache lock and
request record. A leak is localised by comparing call graphs: a path that does return the
resource shows the release chain (e.g. step -> finish -> free -> SlotPool.free); the leaking
path entered that chain and stopped somewhere: the deepest chain function it entered is where
the release went missing."""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

from ..call_trace import CallRecorder, ouro_stack
from ..findings import Finding
from .paths import PATHS, make_engine

PROBE = "leaks"
RESOURCES = {   # resource -> the function that gives it back (file suffix, name)
    "slots": ("engine/page_pool.py", "free"),
    "pages": ("engine/page_pool.py", "decref"),
    "checkpoints": ("engine/checkpointer.py", "release"),
}


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", help="preset name or checkpoint directory (default: tiny)")
    p.add_argument("--seed", type=int, default=0)


def _holdings(e) -> dict:
    """Free counts (more is better); requests still tracked count negatively."""
    s = e.scheduler
    out = {"pages": e.pages.num_free, "slots": e.slots.num_free,
           "requests": -(len(e.requests) + len(s.running) + len(s.waiting))}
    if e.checkpointer.store is not None:
        out["checkpoints"] = e.checkpointer.free()
    return out


class HandleDrops:
    """Records where a request let go of a slot or pages (`req.slot = None`, `req.pages = []`):
    a handle dropped without the resource being given back names the function that lost it."""
    ATTRS = {"slot": "slots", "pages": "pages"}

    def __init__(self):
        self.events = []   # (resource, ids dropped, innermost ouro frame)

    @contextmanager
    def recording(self):
        from ...engine.request import Request
        original = Request.__setattr__

        def setattr_(obj, name, value):
            if name in self.ATTRS:
                old = obj.__dict__.get(name)
                dropped = _ids(old) - _ids(value)
                if dropped:
                    stack = ouro_stack(sys._getframe(1))
                    self.events.append((self.ATTRS[name], dropped, stack[-1] if stack else None))
            original(obj, name, value)

        Request.__setattr__ = setattr_
        try:
            yield self
        finally:
            Request.__setattr__ = original


def _ids(v) -> set:
    if v is None:
        return set()
    return set(v) if isinstance(v, (list, tuple, set)) else {v}


def _held(e) -> dict:
    return {"slots": {i for i, u in enumerate(e.slots._in_use) if u},
            "pages": {i for i, r in enumerate(e.pages._ref) if r > 0}}


def check_paths(model_dir: str, seed: int = 0) -> list[dict]:
    """Run every path on a fresh engine; per path: what each resource lost, the calls made and
    the stacks at each release."""
    g = torch.Generator().manual_seed(seed)
    results = []
    engines = {}
    for name, prefix, fn in PATHS:
        if prefix not in engines:
            engines[prefix] = make_engine(model_dir, prefix)
        e = engines[prefix]
        vocab = e.model.config.vocab_size
        prompt = torch.randint(20, vocab, (40,), generator=g).tolist()
        before, held_before = _holdings(e), _held(e)
        rec, drops = CallRecorder(dict(RESOURCES)), HandleDrops()
        error = None
        with rec.recording(), drops.recording():
            try:
                fn(e, prompt)
            except Exception as ex:   # a path that crashes is a finding too
                error = f"{type(ex).__name__}: {ex}"
        e.reset_prefix_cache()
        after = _holdings(e)
        lost = {k: before[k] - after[k] for k in before if before[k] - after[k] > 0}
        held = _held(e)
        lost_ids = {k: held[k] - held_before[k] for k in held}
        dropped_at = {}   # resource -> frame that dropped a handle to a resource still held
        for resource, ids, frame in drops.events:
            if frame is not None and ids & lost_ids.get(resource, set()):
                dropped_at.setdefault(resource, frame)
        results.append({"path": name, "lost": lost, "called": rec.called, "stacks": rec.stacks, "error": error,
                        "dropped_at": dropped_at})
    return results


def _culprit(resource: str, leaking: dict, results: list[dict]):
    """The deepest function of a working release chain that the leaking path entered."""
    best = None
    for r in results:
        if resource in r["lost"] or r["error"]:
            continue
        for chain in r["stacks"].get(resource, []):
            for depth, frame in enumerate(reversed(chain[:-1])):   # nearest the release first
                if frame in leaking["called"]:
                    if best is None or depth < best[0]:
                        best = (depth, frame, chain)
                    break
    return best


def findings_from(results: list[dict]) -> list[Finding]:
    out = []
    for r in results:
        if r["error"]:
            out.append(Finding(PROBE, "error", f"path '{r['path']}' raised {r['error']}", {},
                               measured=r["error"], expected="no exception", next="ouro probe leaks --json F"))
        for resource, n in r["lost"].items():
            cul = _culprit(resource, r, results)
            where, chain_text = {}, None
            if resource in r["dropped_at"]:     # the handle was dropped there, still held
                file, fn, line = r["dropped_at"][resource]
                where = {"file": file, "function": fn, "line": line}
                if cul is not None:
                    chain_text = " -> ".join(f for _, f, _ in cul[2])
                summary = (f"path '{r['path']}' did not return {n} {resource.rstrip('s')}(s): {fn}() dropped "
                           f"the request's handle to it without giving it back")
            elif cul is not None:
                _, (file, fn, line), chain = cul
                where = {"file": file, "function": fn, "line": line}
                chain_text = " -> ".join(f for _, f, _ in chain)
            if resource not in r["dropped_at"]:
                summary = (f"path '{r['path']}' did not return {n} {resource.rstrip('s')}(s)"
                           + (f"; the release chain {chain_text} stops after {where['function']}()" if where else ""))
            out.append(Finding(PROBE, "error", summary, where, measured={resource: n}, expected={resource: 0},
                               evidence={"lost_by_path": {x["path"]: x["lost"] for x in results if x["lost"]},
                                         "release_chain": chain_text},
                               next="ouro probe leaks --json F; then read the function named in where"))
    clean = [r["path"] for r in results if not r["lost"] and not r["error"]]
    out.append(Finding(PROBE, "info", f"{len(clean)} of {len(results)} request paths return every page, slot and record",
                       {}, measured=len(clean), expected=len(results), evidence={"clean_paths": clean}))
    # the leak whose culprit is named first, then by how much was lost
    out.sort(key=lambda f: (-f.rank, not f.where, -sum((f.measured or {}).values()) if isinstance(f.measured, dict) else 0))
    return out


def probe_leaks(model: str = "tiny", seed: int = 0) -> list[Finding]:
    from ...models.resolve import resolve_model
    return findings_from(check_paths(str(resolve_model(model, progress=False)), seed))


def run(args) -> list[Finding]:
    return probe_leaks(args.model, args.seed)
