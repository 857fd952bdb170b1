"""The Infra Agent's contract (`agent.toml`): its goal, the paths it may write, the paths it may
only read, the kinds of change a person must approve, and its limits.

`ouro agent init` writes the commented default; `Contract.load` reads one. The rules:
- a frozen path is never edited (frozen wins over writable); anything outside the writable
  paths is not edited either;
- a change whose path or text falls in a risk class (numerics, async, production) is parked for
  review instead of kept;
- an edit that loosens a tolerance, switches precision or caches outputs is a numerics change by
  these patterns, so it is parked too.
"""

from __future__ import annotations

import fnmatch
import posixpath
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT = '''# The Infra Agent's contract: `ouro agent` reads this before it changes anything.

[goal]
# "budget": make a budget of the lab pass; "metric": move one measurement in a direction;
# "probe": make a lab probe's findings go away (what `ouro agent eval` sets for a planted fault).
kind = "budget"
budget = "prefill + KV transfer within 5% of prefill alone"   # a name in budgets/default.toml
# kind = "metric"
# metric = "decode_step_ms"     # a measurement of a lab scenario (ouro/lab/scenarios.py)
# direction = "lower"
# scenario = "decode"
# kind = "probe"
# probe = ["redundancy", "--model", "tiny"]      # the arguments of `ouro probe`
model = "tiny"                  # the model every check and measurement runs

[paths]
# What the agent may edit (globs from the repository root).
writable = ["ouro/ops/**", "ouro/layers/**", "ouro/engine/**", "ouro/disagg/**", "ouro/parallel/**"]
# What it may read but never change: the tests, the naive references, the budgets, the lab
# itself and its tolerance tables, the benchmarks' inputs and timers, and this file.
frozen = ["tests/**", "budgets/**", "ouro/lab/**", "ouro/measure/**", "ouro/bench/**", "ouro/agent/**", "ouro/ops/**/naive*.py",
          "ouro/ops/**/reference*.py", "agent.toml", ".ci/**", "pyproject.toml"]

[checks]
# Before a change is kept: these tests (pytest arguments, run in the agent's worktree) ...
tests = ["tests/ops/test_kda.py", "tests/ops/test_dsa.py", "tests/ops/test_moe.py", "tests/engine/test_engine.py"]
# ... and a held-out sweep: this many numerics probes of ouro against transformers, each with a
# seed, a prompt length and a serving configuration drawn when the change is submitted.
heldout = 2

[bench]
# The A/B benchmark: the agent's tree against the one it started from, interleaved, medians.
# A "metric" or "budget" goal measures its own scenario; this one serves a "probe" goal.
scenario = "decode"
metric = "decode_step_ms"
direction = "lower"
repeats = 5

[risk]
# A change touching these needs a person's approval (`ouro agent review`): the paths it edits
# (globs) or the lines it adds or removes (regular expressions).
numerics = ["\\\\bdtype\\\\b", "float16|bfloat16|float64|tf32|fp32_precision|allow_tf32", "\\\\bprecision\\\\b",
            "\\\\btol(erance)?s?\\\\b|\\\\batol\\\\b|\\\\brtol\\\\b", "accumulat", "lru_cache|functools\\\\.cache|memoi[sz]"]
async = ["\\\\bthreading\\\\b|Thread\\\\(|\\\\bLock\\\\(|\\\\bRLock\\\\(|Condition\\\\(", "\\\\basyncio\\\\b|\\\\bawait\\\\b|async def",
         "\\\\bGIL\\\\b|gil_scoped", "multiprocessing|subprocess|\\\\bzmq\\\\b|socket"]
production = ["ouro/serve/**", "ouro/engine/scheduler.py", "ouro/config/**", "ouro/disagg/rooms.py",
              "ouro/serve/messages.py"]

[limits]
iterations = 20          # submitted changes (hypothesis -> edit -> check -> measure rounds)
wall_seconds = 3600
tokens = 2000000         # prompt + completion tokens of the LLM
tool_seconds = 900       # the longest one tool run (tests, a probe, a benchmark) may take
'''

RISK_CLASSES = ("numerics", "async", "production")
GOALS = {"budget": ("budget",), "metric": ("metric", "direction", "scenario"), "probe": ("probe",)}
LIMITS = {"iterations": 20, "wall_seconds": 3600, "tokens": 2_000_000, "tool_seconds": 900}
CHECKS = {"tests": [], "heldout": 2}
BENCH = {"scenario": "decode", "metric": "decode_step_ms", "direction": "lower", "repeats": 5}
# every key a contract may hold, by table: another (a misspelt `iteratons`, a `[limit]` table) would
# otherwise be dropped without a word and its default used
KEYS = {"goal": ("kind", "model", *{k for need in GOALS.values() for k in need}), "paths": ("writable", "frozen"),
        "risk": RISK_CLASSES, "limits": tuple(LIMITS), "checks": tuple(CHECKS), "bench": tuple(BENCH)}


class ContractError(ValueError):
    """A contract file that does not say what the agent needs to know."""


class EditRefused(PermissionError):
    """An edit the contract does not allow (a frozen path, or one outside the writable paths)."""


def _match(path: str, globs) -> str | None:
    p = posixpath.normpath(Path(path).as_posix())     # "pkg/../tests/x.py" is tests/x.py
    return next((g for g in globs if fnmatch.fnmatchcase(p, g) or fnmatch.fnmatchcase(p, g.replace("/**", ""))), None)


@dataclass
class Contract:
    goal: dict
    writable: list[str]
    frozen: list[str]
    risk: dict[str, list[str]]
    limits: dict = field(default_factory=dict)
    checks: dict = field(default_factory=dict)
    bench: dict = field(default_factory=dict)

    @classmethod
    def load(cls, path) -> "Contract":
        try:
            doc = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ContractError(f"no contract at {path}: write one with `ouro agent init`") from None
        except tomllib.TOMLDecodeError as e:
            raise ContractError(f"{path} is not valid TOML: {e}") from None
        return cls.from_dict(doc, str(path))

    @classmethod
    def from_dict(cls, doc: dict, where: str = "the contract") -> "Contract":
        for table in doc:
            if table not in KEYS or not isinstance(doc[table], dict):
                raise ContractError(f"{where}: {table!r} is not a table of the contract; its tables are "
                                    f"{', '.join(f'[{t}]' for t in KEYS)}")
            unknown = sorted(set(doc[table]) - set(KEYS[table]))
            if unknown:
                raise ContractError(f"{where}: [{table}] has no key {unknown[0]!r}; it takes {', '.join(KEYS[table])}")
        goal = doc.get("goal", {})
        if goal.get("kind") not in GOALS:
            raise ContractError(f"{where}: [goal] kind must be one of {', '.join(GOALS)}, got {goal.get('kind')!r}")
        need = GOALS[goal["kind"]]
        missing = [k for k in need if not goal.get(k)]
        if missing:
            raise ContractError(f"{where}: a {goal['kind']} goal needs {', '.join(missing)} in [goal]")
        if goal["kind"] == "metric" and goal["direction"] not in ("lower", "higher"):
            raise ContractError(f"{where}: [goal] direction must be \"lower\" or \"higher\"")
        paths = doc.get("paths", {})
        if not paths.get("writable"):
            raise ContractError(f"{where}: [paths] writable is empty: the agent could change nothing")
        risk = {k: list(doc.get("risk", {}).get(k, [])) for k in RISK_CLASSES}
        for name, patterns in risk.items():
            for pat in patterns:
                if "*" not in pat and "/" not in pat:
                    try:
                        re.compile(pat)
                    except re.error as e:
                        raise ContractError(f"{where}: [risk] {name} pattern {pat!r} is not a regular expression: {e}") \
                            from None
        if goal["kind"] == "probe" and not (isinstance(goal["probe"], list) and goal["probe"]):
            raise ContractError(f"{where}: [goal] probe must be the argument list of `ouro probe`")
        limits = {**LIMITS, **doc.get("limits", {})}
        checks = {**CHECKS, **doc.get("checks", {})}
        bench = {**BENCH, **doc.get("bench", {})}
        for section, values, keys in (("limits", limits, LIMITS), ("checks", checks, ("heldout",)),
                                      ("bench", bench, ("repeats",))):
            bad = [k for k in keys if not isinstance(values[k], int) or isinstance(values[k], bool)
                   or values[k] < (0 if k == "heldout" else 1)]
            if bad:
                raise ContractError(f"{where}: [{section}] {bad[0]} must be a positive integer")
        if not isinstance(checks["tests"], list):
            raise ContractError(f"{where}: [checks] tests must be a list of pytest arguments")
        if bench["direction"] not in ("lower", "higher"):
            raise ContractError(f"{where}: [bench] direction must be \"lower\" or \"higher\"")
        return cls(goal, list(paths["writable"]), list(paths.get("frozen", [])), risk, limits, checks, bench)

    def model(self) -> str:
        return self.goal.get("model", "tiny")

    def check_edit(self, path: str) -> None:
        """Raise EditRefused unless the agent may edit `path` (repository-relative)."""
        if posixpath.normpath(Path(path).as_posix()).startswith(("..", "/")):
            raise EditRefused(f"{path} is outside the repository")
        frozen = _match(path, self.frozen)
        if frozen:
            raise EditRefused(f"{path} is frozen by the contract ({frozen!r}): read it, never change it")
        if not _match(path, self.writable):
            raise EditRefused(f"{path} is outside the writable paths {self.writable}")

    def risk_classes(self, path: str, changed_lines: list[str]) -> list[str]:
        """The risk classes an edit falls in: by the path it touches (globs) or by the text of
        the lines it adds or removes (regular expressions)."""
        out = []
        for name, patterns in self.risk.items():
            for pat in patterns:
                if "*" in pat or "/" in pat:
                    hit = _match(path, [pat]) is not None
                else:
                    rx = re.compile(pat)
                    hit = any(rx.search(line) for line in changed_lines)
                if hit:
                    out.append(name)
                    break
        return out

    def diff_risk_classes(self, diff: str) -> list[str]:
        """The risk classes of a whole unified diff: each file by its path and its changed lines."""
        return sorted({r for path, lines in changed_lines(diff).items() for r in self.risk_classes(path, lines)})


def changed_lines(diff: str) -> dict[str, list[str]]:
    """file -> the lines a unified diff adds or removes."""
    out, path = {}, None
    for line in diff.splitlines():
        if line.startswith(("+++ ", "--- ")):
            name = line[4:].strip()
            if name != "/dev/null":
                path = re.sub(r"^[ab]/", "", name)
                out.setdefault(path, [])
        elif path and line[:1] in "+-":
            out[path].append(line[1:])
    return out


def write_default(path, force: bool = False) -> Path:
    p = Path(path)
    if p.exists() and not force:
        raise FileExistsError(f"{p} exists; pass --force to overwrite it")
    p.write_text(DEFAULT)
    Contract.load(p)            # the default must itself be a valid contract
    return p
