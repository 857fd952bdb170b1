"""What a trace says: GIL starvation (the heartbeat's delay during each span, with the thread
that held the GIL and where), idle gaps of the engine loop while requests are pending, time and
share per category, and the overlap between categories on different lanes."""

from __future__ import annotations

import bisect
import statistics
from collections import Counter, defaultdict

from ..findings import Finding

PROBE = "timeline"
GIL_FLOOR_MS = 2.0          # heartbeat delay below this is ordinary scheduling, whatever the baseline
GIL_BASELINE_FACTOR = 5.0
MIN_WATCH_PERIODS = 20      # a heartbeat watched for fewer periods than this says nothing
CULPRIT_MIN_CPU_SHARE = 0.2  # another thread ran at least this share of the late intervals
CULPRIT_BUSY_SHARE = 0.5     # ...outside its own work spans: a thread busy in `forward` is computing, not waiting
GAP_MIN_MS = 5.0
NEXT = "ouro probe timeline --trace-out t.json, then open t.json in https://ui.perfetto.dev"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def _rel(t: float, t0: float) -> float:
    return round(t - t0, 3)


# ---- GIL starvation ----
def _in_spans(times: list[float], spans: list[dict]) -> list[int]:
    idx = set()
    for s in spans:
        lo, hi = bisect.bisect_left(times, s["start_ms"]), bisect.bisect_right(times, s["end_ms"])
        idx.update(range(lo, hi))
    return sorted(idx)


def _culprit(late: list[dict], own_thread: str) -> dict | None:
    cpu, interval, where = Counter(), 0.0, defaultdict(Counter)
    for s in late:
        interval += s.get("interval_ms") or 0.0
        for t in s.get("threads", []):
            if t["thread"] == own_thread:
                continue
            cpu[t["thread"]] += t.get("cpu_ms") or 0.0
            if t.get("where"):
                w = t["where"]
                where[t["thread"]][(w["file"], w["function"], w["line"])] += 1
    if not cpu or interval <= 0:
        return None
    name, used = cpu.most_common(1)[0]
    loc = where[name].most_common(1)[0][0] if where[name] else (None, None, None)
    return {"thread": name, "cpu_share": used / interval, "file": loc[0], "function": loc[1], "line": loc[2],
            "others": {k: round(v / interval, 3) for k, v in cpu.most_common(4)}}


def _contended(sample: dict) -> bool:
    """A late wake during which some other Python thread ran for a fair share of the interval."""
    interval = sample.get("interval_ms") or 0.0
    return interval > 0 and any((t.get("cpu_ms") or 0.0) >= CULPRIT_MIN_CPU_SHARE * interval
                                for t in sample.get("threads", []))


def _busy_share(spans: list[dict], thread: str, late: list[dict]) -> float:
    """Share of the late wakes at which `thread` was inside one of its own work spans."""
    own = sorted(((x["start_ms"], x["end_ms"]) for x in spans if x["thread"] == thread and x["cat"] != "pending"))
    if not late or not own:
        return 0.0
    starts = [a for a, _ in own]
    busy = 0
    for s in late:
        i = bisect.bisect_right(starts, s["at_ms"]) - 1
        busy += any(a <= s["at_ms"] <= b for a, b in own[max(0, i - 8):i + 1])
    return busy / len(late)


def gil_findings(spans: list[dict], heartbeats: dict, t0: float) -> list[Finding]:
    out = []
    for pid, hb in heartbeats.items():
        samples = sorted(hb["samples"])
        # too short a watch to judge: fewer than MIN_WATCH_PERIODS heartbeat periods. Not "too few
        # wakes": a starved heartbeat wakes rarely, and that is the finding (a 0.9 s prefill on a fast
        # machine, its GIL held by a spinning thread, gave 18 wakes where ~900 were due)
        if len(samples) < 2 or samples[-1][0] - samples[0][0] < MIN_WATCH_PERIODS * hb.get("period_ms", 1.0):
            continue
        times, delays = [s[0] for s in samples], [s[1] for s in samples]
        mine = [s for s in spans if s["pid"] == pid]
        inside = set(_in_spans(times, mine))
        # the baseline is the OS's scheduling noise: an idle wake that another Python thread made
        # late is the fault itself (a poller that spins all the time), not noise to forgive
        contended = {s["at_ms"] for s in hb["late"] if _contended(s)}
        quiet = [i for i in range(len(delays)) if times[i] not in contended]
        idle = [delays[i] for i in quiet if i not in inside]
        baseline = (statistics.median(idle) if len(idle) >= 20
                    else pct([delays[i] for i in quiet], 0.1) if quiet else 0.0)
        expected = max(GIL_FLOOR_MS, GIL_BASELINE_FACTOR * baseline)
        late = sorted(hb["late"], key=lambda s: s["at_ms"])
        late_t = [s["at_ms"] for s in late]
        by_culprit: dict = {}
        groups = defaultdict(list)
        for s in mine:
            if s["cat"] != "pending":      # a window, not work: its spans say where
                groups[(s["name"], s["thread"])].append(s)
        for (name, thread), inst in groups.items():
            idx = _in_spans(times, inst)
            if len(idx) < 5:
                continue
            d = [delays[i] for i in idx]
            p90, p99 = pct(d, 0.9), pct(d, 0.99)
            if p90 <= expected:
                continue
            late_in = [late[i] for i in _in_spans(late_t, inst)]
            c = _culprit(late_in, thread)
            worst = max(inst, key=lambda s: max((delays[i] for i in _in_spans(times, [s])), default=0.0))
            key = (c["thread"], c["file"], c["function"]) if c and c["cpu_share"] >= CULPRIT_MIN_CPU_SHARE else None
            if key is not None and _busy_share(mine, c["thread"], late_in) >= CULPRIT_BUSY_SHARE:
                key = None   # the other thread was doing its own traced work: contention, not a wait
            entry = by_culprit.setdefault(key, {"culprit": c, "spans": [], "p90": 0.0, "worst": worst, "p99": 0.0})
            entry["spans"].append({"span": name, "thread": thread, "delay_p90_ms": round(p90, 2),
                                   "delay_p99_ms": round(p99, 2), "samples": len(d)})
            if p90 > entry["p90"]:
                entry.update(p90=p90, p99=p99, worst=worst)
        for key, e in sorted(by_culprit.items(), key=lambda kv: (kv[0] is None, -kv[1]["p90"])):
            w, c = e["worst"], e["culprit"]
            interval = [_rel(w["start_ms"], t0), _rel(w["end_ms"], t0)]
            names = ", ".join(sorted({s["span"] for s in e["spans"]}))
            evidence = {"baseline_delay_ms": round(baseline, 3), "spans": e["spans"][:8],
                        "culprit": c, "process": w["process"]}
            if key is not None:
                out.append(Finding(PROBE, "warning",
                                   f"GIL starvation: while {names} ran on {w['thread']}, the heartbeat woke "
                                   f"{e['p90']:.1f} ms late (p90; baseline {baseline:.2f} ms) because thread "
                                   f"{c['thread']!r} kept running Python in {c['function']}()",
                                   where={"file": c["file"], "function": c["function"], "line": c["line"],
                                          "thread": c["thread"], "interval": interval},
                                   measured={"delay_p90_ms": round(e["p90"], 2), "delay_p99_ms": round(e["p99"], 2),
                                             "culprit_cpu_share": round(c["cpu_share"], 3)},
                                   expected={"delay_p90_ms_at_most": round(expected, 2)}, evidence=evidence,
                                   next=f"read {c['file']}:{c['line']}: a wait there should block (queue.get, "
                                        "Event.wait), not poll; " + NEXT))
            else:
                out.append(Finding(PROBE, "info",
                                   f"the heartbeat woke {e['p90']:.1f} ms late (p90) during {names}, but no other "
                                   "thread of this process ran outside its own traced work meanwhile: ordinary "
                                   "contention, the OS or the span's own Python",
                                   where={"thread": w["thread"], "interval": interval},
                                   measured={"delay_p90_ms": round(e["p90"], 2)},
                                   expected={"delay_p90_ms_at_most": round(expected, 2)}, evidence=evidence, next=NEXT))
    return out


# ---- idle gaps ----
def _union(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def gap_findings(spans: list[dict], t0: float) -> list[Finding]:
    """Inside each 'pending' window (the engine has unfinished requests), the stretches where the
    thread that runs the engine steps does nothing traced."""
    out = []
    for pid in {s["pid"] for s in spans}:
        mine = [s for s in spans if s["pid"] == pid]
        windows = [s for s in mine if s["cat"] == "pending"]
        steps = [s for s in mine if s["name"] == "step"]
        if not windows or not steps:
            continue
        lane = Counter(s["tid"] for s in steps).most_common(1)[0][0]
        busy = _union([(s["start_ms"], s["end_ms"]) for s in mine if s["tid"] == lane and s["cat"] != "pending"])
        step_ms = statistics.median(s["dur_ms"] for s in steps)
        gaps, total = [], 0.0
        for w in windows:
            total += w["dur_ms"]
            cur = w["start_ms"]
            for a, b in busy:
                if b <= w["start_ms"] or a >= w["end_ms"]:
                    continue
                if a > cur:
                    gaps.append((a - cur, cur, a))
                cur = max(cur, b)
            if w["end_ms"] > cur:
                gaps.append((w["end_ms"] - cur, cur, w["end_ms"]))
        threshold = max(GAP_MIN_MS, 2.0 * step_ms)
        big = sorted((g for g in gaps if g[0] > threshold), reverse=True)
        if not big:
            continue
        idle = sum(g[0] for g in gaps)
        share = idle / total if total else 0.0
        severe = share > 0.3 and big[0][0] > 3 * step_ms
        thread = steps[0]["thread"]
        for k, (dur, a, b) in enumerate(big[:3]):
            out.append(Finding(PROBE, "warning" if severe and k == 0 else "info",
                               f"the engine loop on {thread} sat idle {dur:.1f} ms while requests were pending "
                               f"({share:.0%} of the pending time idle; a step takes {step_ms:.1f} ms)",
                               where={"thread": thread, "interval": [_rel(a, t0), _rel(b, t0)]},
                               measured={"gap_ms": round(dur, 2), "idle_share": round(share, 3)},
                               expected={"gap_ms_at_most": round(threshold, 2)},
                               evidence={"gaps_over_threshold": len(big), "pending_ms": round(total, 1)}, next=NEXT))
    return out


# ---- categories and overlap ----
def exclusive_times(spans: list[dict]) -> dict:
    """Each category's self time: a span's time minus its children's on the same lane."""
    out = Counter()
    for lane in {(s["pid"], s["tid"]) for s in spans if not (isinstance(s["tid"], int) and s["tid"] < 0)}:
        stack = []   # (virtual lanes, tid < 0, hold overlapping async lifetimes, not work)
        for s in sorted((s for s in spans if (s["pid"], s["tid"]) == lane and s["cat"] != "pending"),
                        key=lambda s: (s["start_ms"], -s["dur_ms"])):
            while stack and stack[-1]["end_ms"] <= s["start_ms"]:
                stack.pop()
            out[s["cat"]] += s["dur_ms"]
            if stack:
                out[stack[-1]["cat"]] -= min(s["dur_ms"], stack[-1]["end_ms"] - s["start_ms"])
            stack.append(s)
    return dict(out)


def overlap(spans: list[dict], a: str, b: str) -> float | None:
    """Share of category a's time during which b runs on another lane."""
    total, covered = 0.0, 0.0
    for lane in {(s["pid"], s["tid"]) for s in spans if s["cat"] == a}:
        ua = _union([(s["start_ms"], s["end_ms"]) for s in spans if s["cat"] == a and (s["pid"], s["tid"]) == lane])
        ub = _union([(s["start_ms"], s["end_ms"]) for s in spans if s["cat"] == b and (s["pid"], s["tid"]) != lane])
        for x0, x1 in ua:
            total += x1 - x0
            for y0, y1 in ub:
                covered += max(0.0, min(x1, y1) - max(x0, y0))
    return covered / total if total else None


def category_findings(spans: list[dict]) -> list[Finding]:
    excl = exclusive_times(spans)
    total = sum(excl.values())
    if not total:
        return []
    share = {c: round(v / total, 4) for c, v in sorted(excl.items(), key=lambda kv: -kv[1])}
    text = ", ".join(f"{c} {v:.0%}" for c, v in list(share.items())[:6])
    out = [Finding(PROBE, "info", f"traced time by category (self time): {text}",
                   measured={"ms": {c: round(v, 2) for c, v in excl.items()}, "share": share},
                   evidence={"spans": len(spans)}, next=NEXT)]
    cats = [c for c in share if c != "pending"]
    pairs = [("transfer", "compute")] if {"transfer", "compute"} <= set(cats) else []
    pairs += [(x, y) for x in cats for y in cats if x != y and (x, y) not in pairs]
    rows = {}
    for x, y in pairs[:12]:
        f = overlap(spans, x, y)
        if f is not None:
            rows[f"{x}|{y}"] = round(f, 4)
    rows = {k: v for k, v in rows.items() if v > 0} or ({} if not rows else {})
    if rows:
        first = "transfer|compute"
        head = first if first in rows else max(rows, key=rows.get)
        a, b = head.split("|")
        out.append(Finding(PROBE, "info", f"{rows[head]:.0%} of {a} time overlaps {b} on another lane",
                           measured=rows, evidence={"pairs": "a|b: share of a's time with b running elsewhere"},
                           next=NEXT))
    return out


def analyse(spans: list[dict], heartbeats: dict) -> list[Finding]:
    if not spans:
        return [Finding(PROBE, "warning", "the trace holds no spans: was the tracer on?", next=NEXT)]
    t0 = min(s["start_ms"] for s in spans)
    return gil_findings(spans, heartbeats, t0) + gap_findings(spans, t0) + category_findings(spans)
