"""The agent's tools: their schemas (OpenAI function calling) and the dispatch from a call to
the workspace, the lab and the judge. Every observation is bounded (`bounded.cut`) and every
run says whether it finished (`[done, exit N, ...]` or `[timed-out, ...]`).

Dense feedback gives the model every tool. Sparse feedback gives it only what a team without
the lab has: the files, the edits, whether the tests pass (no output) and end-to-end
throughput; no probes, no test output, no per-op measurements.
"""

from __future__ import annotations

import json

from .bounded import cut

_S, _I = {"type": "string"}, {"type": "integer"}
_LIST = {"type": "array", "items": _S}


def _tool(name: str, description: str, props: dict | None = None, required: tuple = ()) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props or {}, "required": list(required)}}}


TOOLS = {
    "list_files": _tool("list_files", "List the repository's files matching a glob.", {"glob": _S}),
    "read_file": _tool("read_file", "Read a window of numbered lines of a file.",
                       {"path": _S, "start": _I, "count": _I}, ("path",)),
    "search": _tool("search", "Search files for a Python regular expression; file:line: text per hit.",
                    {"pattern": _S, "glob": _S}, ("pattern",)),
    "hypothesis": _tool("hypothesis", "Before editing: the question, your hypothesis, and the cheapest check "
                        "that would confirm it. Recorded in the journal with the change that follows.",
                        {"question": _S, "hypothesis": _S, "check": _S}, ("hypothesis",)),
    "edit": _tool("edit", "Replace the one exact occurrence of `old` in a file with `new`. Refused on frozen or "
                  "non-writable paths, when `old` is missing or repeated, or when the file would not parse.",
                  {"path": _S, "old": _S, "new": _S}, ("path", "old", "new")),
    "diff": _tool("diff", "The working change against the last kept state."),
    "revert": _tool("revert", "Undo the working change (one file, or all of it).", {"path": _S}),
    "run_tests": _tool("run_tests", "Run pytest on a selection (paths, -k expressions) in the workspace.",
                       {"tests": _LIST}, ("tests",)),
    "run_probe": _tool("run_probe", "Run a lab probe (`ouro probe ARGS`, e.g. [\"numerics\", \"--model\", "
                       "\"tiny\", \"--a\", \"mode=prefill\", \"--b\", \"mode=decode\"], [\"redundancy\", \"--model\", "
                       "\"tiny\"], [\"budgets\"]) and get its findings: severity, summary, where, measured, expected.",
                       {"args": _LIST}, ("args",)),
    "run_benchmark": _tool("run_benchmark", "A/B benchmark of the working tree against the kept state: "
                           "interleaved repeats, medians, an interval and a noise estimate."),
    "submit": _tool("submit", "Submit the working change. The harness re-runs the contract's tests and a held-out "
                    "numerics sweep, measures it, and keeps it, reverts it, or parks it for a person's review.",
                    {"summary": _S}, ("summary",)),
    "finish": _tool("finish", "End the run (the goal is met, or you see nothing more to try).", {"summary": _S}),
}
SPARSE = ("list_files", "read_file", "search", "hypothesis", "edit", "diff", "revert", "run_tests", "run_benchmark",
          "submit", "finish")


def schemas(feedback: str) -> list[dict]:
    names = SPARSE if feedback == "sparse" else tuple(TOOLS)
    return [TOOLS[n] for n in names]


class Toolbox:
    """Runs one tool call. `submit`, `finish` and `hypothesis` are the loop's (it passes them in)."""

    def __init__(self, workspace, run, feedback: str = "dense"):
        self.ws, self.run, self.feedback = workspace, run, feedback
        self.names = {t["function"]["name"] for t in schemas(feedback)}

    def call(self, name: str, args: dict) -> str:
        if name not in self.names:
            return f"there is no tool {name!r} in this run; the tools are {', '.join(sorted(self.names))}"
        try:
            return getattr(self, "_" + name)(**args)
        except TypeError as e:             # missing or unexpected arguments: the model's mistake
            return f"bad arguments for {name}: {e}; its parameters: {json.dumps(TOOLS[name]['function']['parameters'])}"

    def _list_files(self, glob: str = "**/*.py") -> str:
        return self.ws.list_files(glob)

    def _read_file(self, path: str, start: int = 1, count: int = 200) -> str:
        return self.ws.read_file(path, int(start), int(count))

    def _search(self, pattern: str, glob: str = "**/*.py") -> str:
        return self.ws.search(pattern, glob)

    def _hypothesis(self, hypothesis: str, question: str = "", check: str = "") -> str:
        return self.run.note_hypothesis(question, hypothesis, check)

    def _edit(self, path: str, old: str, new: str) -> str:
        out = self.ws.edit(path, old, new)
        if out.startswith("refused"):
            self.run.refused(path, out)
        return out

    def _diff(self) -> str:
        return self.ws.diff()

    def _revert(self, path: str | None = None) -> str:
        return self.ws.revert(path)

    def _run_tests(self, tests: list) -> str:
        if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
            return "tests must be a list of strings (pytest arguments)"
        obs = self.ws.tests(tests, timeout_s=self.run.tool_seconds)
        if self.feedback == "sparse":      # pass or fail, nothing that says where
            return "tests: " + ("passed" if obs.state == "done" and obs.exit_code == 0 else "failed")
        return obs.render()

    def _run_probe(self, args: list) -> str:
        if not isinstance(args, list) or not args or not all(isinstance(a, str) for a in args):
            return "args must be a non-empty list of strings: the arguments of `ouro probe`"
        text, _ = self.ws.run_probe(args, timeout_s=self.run.tool_seconds)
        return text

    def _run_benchmark(self) -> str:
        return cut(self.run.benchmark_text(), self.ws.limit)

    def _submit(self, summary: str = "") -> str:
        return self.run.submit(summary)

    def _finish(self, summary: str = "") -> str:
        return self.run.finish(summary)
