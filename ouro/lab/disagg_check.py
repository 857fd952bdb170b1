"""`ouro probe disagg`: a prefill engine and a decode engine joined by a real transfer (tcp on
127.0.0.1), driven hard enough that rooms time out mid-transfer, requests are aborted on both
sides and pages are reused at once; then every completed output is checked against one engine's
greedy tokens, every write into the decode cache against the room that owned those pages, and
both sides' pools against full.

Findings:
- error: a transfer frame written into a room after that room was freed (its pages may already
  be another request's): where it was freed (the room table's path, from its reason), the
  request, the pages, the seconds between the free and the write;
- error: a completed output that departs from the reference (text from another request's cache),
  with the position of the first wrong token;
- error: pages or slots that did not come back on either side;
- info: how the run went (completed, failed with an error, aborted, timed out).
"""

from __future__ import annotations

import random
import time

from .findings import Finding

PROBE = "disagg"


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", help="preset name or checkpoint directory (default: tiny)")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--room-timeout", type=float, default=0.25, help="the decode side's room deadline, seconds")
    p.add_argument("--seed", type=int, default=0)


def run(args) -> list[Finding]:
    from ..models.resolve import resolve_model
    return check(str(resolve_model(args.model, progress=False)), args.requests, args.room_timeout, args.seed)


def _engine(model_dir, batched: int = 64, **kw):
    from ..config import EngineConfig
    from ..engine.llm_engine import LLMEngine
    from ..models.loader import load_model
    cfg = EngineConfig(dtype="float32", page_size=16, max_memory=32 << 20, max_num_batched_tokens=batched, **kw)
    return LLMEngine(load_model(model_dir, dtype=cfg.torch_dtype()), None, cfg, verbose=False)


def reference(model_dir, prompts, max_tokens) -> list[list[int]]:
    from ..engine.sampling import SamplingParams
    e = _engine(model_dir)
    ids = [e.add_request({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=max_tokens)) for p in prompts]
    out = {i: [] for i in ids}
    while e.has_unfinished():
        for o in e.step():
            out[o.request_id] += o.new_token_ids
    return [out[i] for i in ids]


def check(model_dir, requests: int = 40, room_timeout: float = 0.25, seed: int = 0, max_tokens: int = 6) -> list[Finding]:
    from ..disagg.decode_engine import DecodeEngine, NoRoom
    from ..disagg.prefill_engine import PrefillEngine
    from ..engine.sampling import SamplingParams
    rng = random.Random(seed)
    vocab = 300
    prompts = [[rng.randrange(5, vocab) for _ in range(rng.randrange(8, 300))] for _ in range(requests)]
    want = reference(model_dir, prompts, max_tokens)
    p = PrefillEngine(_engine(model_dir, batched=24))     # long prompts take many steps: stalls land mid-transfer
    d = DecodeEngine(_engine(model_dir, max_num_seqs=8), timeout_s=room_timeout)
    writes, frees = _watch(d)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    got, aborted, pending = {}, set(), list(range(requests))
    stall_until, stalled = 0.0, set()
    t0 = time.monotonic()
    try:
        while (pending or p.has_work() or d.has_work()) and time.monotonic() - t0 < 120:
            while pending and len(p.engine.requests) < 3:             # a short queue: rooms get to receiving
                i = pending.pop(0)
                try:
                    room = d.reserve(f"q{i}", prompts[i], params)
                except NoRoom:
                    pending.insert(0, i)
                    break
                p.add(f"q{i}", prompts[i], params, room)
            now = time.monotonic()
            if rng.random() < 0.01 and got:                           # a client goes away mid-stream
                victim = rng.choice(sorted(set(d.reserved) | set(d.engine.requests)) or [None])
                if victim is not None:
                    d.abort(victim)
                    p.abort(victim)
                    aborted.add(victim)
            for r in p.engine.scheduler.running:       # every third prefill stalls halfway, past its room's deadline
                if int(r.request_id[1:]) % 3 == 1 and r.request_id not in stalled and r.num_computed * 2 >= len(r.prompt_ids):
                    stalled.add(r.request_id)
                    stall_until = now + 1.5 * room_timeout
            if now >= stall_until:
                p.step()
            for o in d.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
            time.sleep(0.002)
    finally:
        p.close()
        d.close()
    failed = dict(d.failures)
    findings = _late_writes(writes, frees)
    wrong = []
    for rid, toks in got.items():
        i = int(rid[1:])
        if rid in aborted or rid in failed or len(toks) != max_tokens:
            continue
        if toks != want[i]:
            first = next(k for k, (a, b) in enumerate(zip(toks, want[i])) if a != b)
            wrong.append({"request": rid, "first_wrong_token": first, "got": toks, "want": want[i]})
    if wrong:
        findings.append(Finding(PROBE, "error", f"{len(wrong)} completed output(s) depart from the reference: text "
                                "from another request's cache", where={"file": "ouro/disagg/decode_engine.py",
                                                                        "function": "_activate"},
                                measured=len(wrong), expected=0, evidence={"outputs": wrong[:5]},
                                next="ouro probe disagg --requests 80   (then the late-write finding, if any, says where)"))
    lost = {side: {"pages": e.pages.num_total - e.pages.num_free, "slots": e.slots.num_total - e.slots.num_free}
            for side, e in (("prefill", p.engine), ("decode", d.engine))}
    if any(v for s in lost.values() for v in s.values()):
        findings.append(Finding(PROBE, "error", f"pages or slots did not come back: {lost}",
                                where={"file": "ouro/disagg/rooms.py"}, measured=lost, expected=0))
    done = sum(1 for rid, t in got.items() if len(t) == max_tokens and rid not in aborted and rid not in failed)
    timed_out = sum(1 for why in failed.values() if "timed out" in why)
    findings.append(Finding(PROBE, "info", f"{requests} requests: {done} completed and checked, {len(failed)} failed "
                            f"with an error ({timed_out} rooms timed out), {len(aborted)} aborted",
                            evidence={"writes": len(writes), "frees": len(frees)}))
    return findings


def _watch(d):
    """Record, on the decode side, when each room's frames were written and when it was freed."""
    writes, frees = [], {}
    resolve, on_event = d.kv._resolve, d.kv.rooms.on_event

    def watched_resolve(header, peer):
        views = resolve(header, peer)
        if views is not None:
            writes.append((header["rid"], time.monotonic(), [p for p in d.kv.rooms.rooms[header["rid"]].pages]))
        return views

    def watched_event(kind, room, reason):
        if kind == "free":          # the first free counts (a second one is itself a symptom)
            frees.setdefault(room.rid, (time.monotonic(), reason, list(room.pages)))
        on_event(kind, room, reason)
    d.kv._resolve = d.kv.receiver.resolve = watched_resolve
    d.kv.rooms.on_event = watched_event
    return writes, frees


def _late_writes(writes, frees) -> list[Finding]:
    late = [(rid, t - frees[rid][0], pages, frees[rid][1]) for rid, t, pages in writes
            if rid in frees and t > frees[rid][0]]
    if not late:
        return []
    rid, after, pages, reason = late[0]
    path = "expire/abort" if "timed out" in (reason or "") or "abort" in (reason or "") else "finished/connection_closed"
    return [Finding(PROBE, "error", f"{len(late)} transfer frame(s) written into rooms already freed (first: {rid}, "
                    f"{after * 1e3:.1f} ms after it was freed: {reason})",
                    where={"file": "ouro/disagg/rooms.py", "function": "abort" if path == "expire/abort" else "finished",
                           "module": "RoomTable"},
                    measured=len(late), expected=0,
                    evidence={"first": {"request": rid, "pages": pages[:16], "ms_after_free": round(after * 1e3, 2),
                                        "freed_because": reason, "freed_by": path}},
                    next="a room that was answered `go` may only be freed on its writer's last frame or its connection's end")]
