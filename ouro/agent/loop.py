"""The agent's loop: baseline -> hypothesis -> edits -> submit -> keep, revert or park, until the
model finishes or a limit is reached (docs/agent.md).

The model works in a detached git worktree; a second one holds the last kept state, which the
A/B benchmark measures against. The harness, never the model, judges a submission: integrity
(writable, not frozen), the contract's tests, a held-out numerics sweep drawn now, the A/B
benchmark and the goal's own check; a change in a risk class is parked, not kept. Only the final
state counts: the run's `final.patch`. The user's tree is never touched.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .bounded import cut
from .contract import Contract, EditRefused
from .goal import Goal
from .journal import Journal
from .review import park
from .review import runs_dir as runs_root
from .measure import BenchError, ab_benchmark, draw_heldout, heldout_sweep, measure_once
from .tools import Toolbox, schemas
from .workspace import Workspace

UNUSABLE_STREAK = 3       # consecutive replies without a usable tool call end the run

SYSTEM = """You are ouro's Infra Agent: you improve ouro, a PyTorch serving stack for GLM-5-class hybrid
models, from the measurements of its lab. Work only through the tools; answer with one tool call at a time.

Goal: {goal}
You may edit: {writable}. Frozen (read, never change): {frozen}.
Changes touching {risks} are parked for a person's review instead of kept.

Each round: state a hypothesis and the cheapest check that would confirm it (`hypothesis`), look at the
code, make the smallest edit, check it with tests{probes}, then `submit`. The harness re-runs the
contract's tests and a held-out numerics sweep on inputs you have not seen, measures the change against
the last kept state, and keeps, reverts or parks it. When the goal is met or nothing is left to try,
call `finish`. Limits: {iterations} submissions, {wall} s, {tokens} tokens."""


@dataclass
class Outcome:
    run_id: str
    run_dir: str
    reason: str                   # why the run ended
    iterations: int
    decisions: list = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    invalid_replies: int = 0
    final_patch: str = ""
    parked: list = field(default_factory=list)


class AgentRun:
    def __init__(self, repo, contract: Contract, llm, feedback: str = "dense", runs_dir=None,
                 run_id: str | None = None, seed: int | None = None, say=None):
        if feedback not in ("dense", "sparse"):
            raise ValueError(f"feedback must be dense or sparse, got {feedback!r}")
        self.repo, self.contract, self.llm, self.feedback = Path(repo).resolve(), contract, llm, feedback
        self.goal = Goal.from_contract(contract, feedback)
        self.run_id = run_id or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        self.dir = Path(runs_dir or runs_root(self.repo)) / self.run_id
        self.journal = Journal(self.dir, "journal")
        self.rng = random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))
        self.say = say or (lambda msg: print(f"ouro agent: {msg}", file=sys.stderr, flush=True))
        self.limits = contract.limits
        self.tool_seconds = float(self.limits["tool_seconds"])
        self.step, self.iterations, self.decisions, self.parked = 0, 0, [], []
        self.pending: dict = {}             # the hypothesis the next submission is journalled with
        self.state: dict = {}               # the kept state's standing: probe findings, tests, measurements
        self.done: str | None = None        # set by finish
        self._t0 = time.monotonic()
        self._mark = (0, self._t0)          # tokens and time at the last journal entry

    # ---- journal ----
    def _tokens(self) -> int:
        return self.llm.tokens["prompt"] + self.llm.tokens["completion"]

    def _record(self, **entry) -> dict:
        tokens, t = self._tokens(), time.monotonic()
        self.step += 1
        row = self.journal.record(self.step, tokens=tokens - self._mark[0], seconds=round(t - self._mark[1], 2),
                                  **entry)
        self._mark = (tokens, t)
        return row

    # ---- what the tools call ----
    def note_hypothesis(self, question: str, hypothesis: str, check: str) -> str:
        self.pending = {"question": question or self.goal.text, "hypothesis": hypothesis, "check": check}
        return "noted; it will be journalled with the change you submit next"

    def refused(self, path: str, why: str) -> None:
        self._record(question=self.pending.get("question", self.goal.text), hypothesis=self.pending.get("hypothesis"),
                     change=f"an edit of {path}", correctness=why, decision="refused",
                     next="the model is told why and goes on")

    def finish(self, summary: str) -> str:
        self.done = summary or "the model finished"
        return "finishing"

    def benchmark_text(self) -> str:
        try:
            r = self._ab()
        except BenchError as e:
            return f"the benchmark failed: {e}"
        return r["text"]

    def _ab(self) -> dict:
        return ab_benchmark(self.base.root, self.ws.root, self.model_dir, self.goal.scenario, self.goal.metric,
                            self.goal.direction, int(self.contract.bench["repeats"]), self.tool_seconds)

    # ---- the standing of a tree ----
    def _tests(self, ws) -> dict:
        sel = list(self.contract.checks["tests"])
        if not sel:
            return {"passed": True, "text": "no tests in the contract's [checks]"}
        obs = ws.tests(sel, timeout_s=self.tool_seconds)
        return {"passed": obs.state == "done" and obs.exit_code == 0, "state": obs.state, "exit": obs.exit_code,
                "seconds": round(obs.seconds, 1), "text": obs.render()}

    def _probe_findings(self, ws) -> list[dict]:
        _, findings = ws.run_probe(self.goal.probe, timeout_s=self.tool_seconds)
        return [f for f in findings if f.get("severity") != "info"]

    def baseline(self) -> str:
        """The starting point, journalled as step 1 and told to the model."""
        self.say(f"measuring the starting point ({self.goal.scenario})")
        measured = measure_once(self.base.root, self.model_dir, self.goal.scenario,
                                timeout_s=self.tool_seconds)
        self.state = {"measurements": measured}
        lines = [f"{self.goal.metric} = {measured.get(self.goal.metric)!r} ({self.goal.scenario} scenario, "
                 f"{self.goal.direction} is better)"]
        if self.feedback == "sparse":
            t = self._tests(self.base)
            self.state["tests"] = t["passed"]
            lines.append("the contract's tests: " + ("passed" if t["passed"] else "failed"))
        elif self.goal.kind == "probe":
            self.state["findings"] = self._probe_findings(self.base)
            lines.append(f"`ouro probe {' '.join(self.goal.probe)}`: {len(self.state['findings'])} warnings/errors: "
                         + json.dumps([{k: f.get(k) for k in ("severity", "summary", "where", "next")}
                                       for f in self.state["findings"]]))
        elif self.goal.kind == "budget":
            met = self.goal.met_by(measured)
            self.state["met"] = met
            lines.append(f"budget check {self.goal.check!r}: {'met' if met else 'not met'} on {json.dumps(measured)}")
        text = "\n".join(lines)
        self._record(question=self.goal.text, measurement=self.state, decision="none",
                     next="the model is given this starting point")
        return text

    # ---- a submission ----
    def submit(self, summary: str) -> str:
        files = self.ws.changed_files()
        if not files:
            return "nothing to submit: the working tree equals the last kept state"
        self.iterations += 1
        diff = self.ws.full_diff()
        entry = {"question": self.pending.get("question", self.goal.text),
                 "hypothesis": self.pending.get("hypothesis") or summary, "change": diff}
        self.pending = {}
        try:                           # integrity: the edit tool refuses these; this makes sure
            for f in files:
                self.contract.check_edit(f)
        except EditRefused as e:
            self.ws.revert()
            return self._decide(entry, "refused", f"integrity: {e}", None, "reverted; frozen paths stay as they were")
        risks = self.contract.diff_risk_classes(diff)
        self.say(f"submission {self.iterations}: running the contract's tests")
        tests = self._tests(self.ws)
        correctness = {"tests": "passed" if tests["passed"] else "failed"}
        if not tests["passed"]:
            self.ws.revert()
            detail = tests["text"] if self.feedback == "dense" else ""
            return self._decide(entry, "reverted", correctness, None, "the tests failed; reverted", detail)
        cases = draw_heldout(int(self.contract.checks["heldout"]), self.rng)
        self.say(f"submission {self.iterations}: held-out numerics sweep ({len(cases)} cases)")
        held = heldout_sweep(self.ws.root, self.contract.model(), cases, self.tool_seconds)
        correctness["heldout"] = held
        if not held["passed"]:
            self.ws.revert()
            detail = json.dumps(held["cases"]) if self.feedback == "dense" else ""
            return self._decide(entry, "reverted", correctness, None,
                                "the held-out sweep disagrees with the reference; reverted", detail)
        self.say(f"submission {self.iterations}: A/B benchmark")
        try:
            ab = self._ab()
        except BenchError as e:
            self.ws.revert()
            return self._decide(entry, "reverted", correctness, {"error": str(e)}, f"the benchmark failed: {e}")
        measurement = {"ab": {k: v for k, v in ab.items() if k != "medians"}}
        progress, why, standing = self._progress(ab, measurement)
        measurement["progress"] = why
        if not progress:
            self.ws.revert()
            return self._decide(entry, "reverted", correctness, measurement, f"no progress ({why}); reverted")
        if risks:
            n = park(self.dir, diff, {"risk": risks, "summary": summary, "files": files, "base": self.ws.head(),
                                      "correctness": correctness, "measurement": measurement,
                                      "hypothesis": entry["hypothesis"]})
            self.parked.append(n)
            self.ws.revert()
            return self._decide(entry, "parked", correctness, measurement,
                                f"it touches {', '.join(risks)}: parked for review as #{n} (`ouro agent review`); "
                                "the tree goes on without it")
        commit = self.ws.commit(f"agent: {summary or entry['hypothesis'] or 'change'}"[:200])
        self.base._git("checkout", "-q", "--detach", commit)
        self.state.update(standing)
        return self._decide(entry, "kept", correctness, measurement, f"kept ({why})")

    def _progress(self, ab: dict, measurement: dict) -> tuple[bool, str, dict]:
        new = {"measurements": ab["medians"]["candidate"]}
        if ab["verdict"] == "worse":
            return False, f"slower: {ab['text']}", new
        if self.feedback == "sparse":
            was = self.state.get("tests")
            new["tests"] = True
            if was is False:
                return True, "the tests passed, which failed before", new
            return ab["verdict"] == "better", ab["text"], new
        if self.goal.kind == "probe":
            self.say(f"submission {self.iterations}: the goal probe")
            now, before = self._probe_findings(self.ws), self.state.get("findings", [])
            measurement["probe"] = {"before": len(before), "after": len(now),
                                    "findings": [f"{f['severity']}: {f['summary']}" for f in now][:5]}
            new["findings"] = now
            if len(now) < len(before):
                return True, f"the goal probe's warnings/errors went from {len(before)} to {len(now)}", new
            return ab["verdict"] == "better", f"the goal probe still reports {len(now)}; {ab['text']}", new
        if self.goal.kind == "budget":
            met = self.goal.met_by(ab["medians"]["candidate"])
            new["met"] = met
            measurement["budget_met"] = met
            if met and not self.state.get("met"):
                return True, f"the budget is met now; {ab['text']}", new
        return ab["verdict"] == "better", ab["text"], new

    def _decide(self, entry: dict, decision: str, correctness, measurement, told: str, detail: str = "") -> str:
        nxt = {"kept": "go on from the kept state", "parked": "go on without the parked change",
               "reverted": "try another hypothesis", "refused": "try another hypothesis"}[decision]
        self._record(**entry, correctness=correctness, measurement=measurement, decision=decision, next=nxt)
        self.decisions.append(decision)
        self.say(f"submission {self.iterations}: {decision}")
        shown = {"decision": decision, "why": told}
        if self.feedback == "dense":
            shown.update(correctness=correctness, measurement=measurement)
        else:
            shown["tests"] = correctness.get("tests") if isinstance(correctness, dict) else None
            if measurement and "ab" in measurement:
                shown["throughput"] = measurement["ab"]["text"]
        return cut(json.dumps(shown, indent=1, default=str) + ("\n" + detail if detail else ""), self.ws.limit)

    # ---- the loop ----
    def _limit_reached(self) -> str | None:
        if self.iterations >= self.limits["iterations"]:
            return f"the iteration limit ({self.limits['iterations']} submissions) was reached"
        if time.monotonic() - self._t0 >= self.limits["wall_seconds"]:
            return f"the wall-time limit ({self.limits['wall_seconds']} s) was reached"
        if self._tokens() >= self.limits["tokens"]:
            return f"the token limit ({self.limits['tokens']}) was reached"
        return None

    def run(self) -> Outcome:
        from ..models.resolve import resolve_model
        self.model_dir = str(resolve_model(self.contract.model(), progress=False))   # from the user's tree: an input
        self.ws = Workspace(self.repo, self.contract)
        self.base = Workspace(self.repo, self.contract)
        self.start = self.ws.head()
        try:
            reason = self._loop()
        except Exception as e:            # the harness itself failed: say so in the journal, then raise
            self._record(decision="stopped", correctness=f"the harness failed: {type(e).__name__}: {e}",
                         next="fix the harness or the contract")
            raise
        finally:
            final = self.ws.full_diff(since=self.start)
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "final.patch").write_text(final)
            self.ws.close()
            self.base.close()
        out = Outcome(self.run_id, str(self.dir), reason, self.iterations, self.decisions, self._tokens(),
                      round(time.monotonic() - self._t0, 1), self.llm.invalid, str(self.dir / "final.patch"),
                      self.parked)
        (self.dir / "outcome.json").write_text(json.dumps(asdict(out), indent=1))
        return out

    def _loop(self) -> str:
        start = self.baseline()
        c = self.contract
        tools = schemas(self.feedback)
        box = Toolbox(self.ws, self, self.feedback)
        messages = [{"role": "system", "content": SYSTEM.format(
            goal=self.goal.text, writable=", ".join(c.writable), frozen=", ".join(c.frozen),
            risks=", ".join(k for k, v in c.risk.items() if v), iterations=self.limits["iterations"],
            wall=self.limits["wall_seconds"], tokens=self.limits["tokens"],
            probes=" and lab probes (`run_probe`)" if self.feedback == "dense" else "")},
            {"role": "user", "content": f"The starting point:\n{start}\nWhat is your first hypothesis?"}]
        streak = 0
        while True:
            reason = self._limit_reached()
            if reason:
                return self._stop(reason)
            try:
                reply = self.llm.chat(messages, tools)
            except Exception as e:         # the endpoint is down or refused: the run ends, journalled
                return self._stop(f"the LLM endpoint failed: {type(e).__name__}: {e}")
            if reply.correction:
                streak += 1
                messages.append({"role": "assistant", "content": reply.text})
                if streak >= UNUSABLE_STREAK:
                    return self._stop(f"{streak} replies in a row were not usable tool calls "
                                      f"(the last: {reply.text[:200]!r}); does the endpoint support tool calling?")
                messages.append({"role": "user", "content": reply.correction})
                continue
            streak = 0
            messages.append(reply.message)
            usable = {call.id for call in reply.calls}
            for tc in reply.message.get("tool_calls", []):
                if tc["id"] not in usable:
                    messages.append({"role": "tool", "tool_call_id": tc["id"], "content": reply.correction or
                                     "that call was not usable (unknown tool or arguments that are not a JSON object)"})
            for call in reply.calls:
                self.say(f"running {call.name}")
                t = time.monotonic()
                obs = box.call(call.name, call.arguments)
                self.say(f"{call.name}: {'timed-out' if obs.startswith('[timed-out') else 'done'} "
                         f"in {time.monotonic() - t:.1f} s")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": obs})
                if self.done:
                    return self._stop(f"the model finished: {self.done}")

    def _stop(self, reason: str) -> str:
        self._record(question=self.goal.text, decision="stopped", correctness=None,
                     measurement={"iterations": self.iterations, "decisions": self.decisions,
                                  "invalid_replies": self.llm.invalid, "tokens_total": self._tokens()},
                     change=self.ws.full_diff(since=self.start) or None, next=reason)
        self.say(reason)
        return reason
