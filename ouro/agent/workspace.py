"""The agent's workspace: a git worktree of the user's repository, detached at its HEAD, where
every tool acts. The user's own tree is never touched; `diff()` is what they may later accept.

Tools (each returns a bounded text observation, never raises for the model's mistakes):
`list_files`, `read_file` (a window of numbered lines), `search` (a regular expression over
files), `edit` (exact search-and-replace, refused on a frozen or non-writable path, on a
snippet that is missing or not unique, or when the Python file would no longer parse), `diff`,
`revert`, `run_tests`, `run_probe` (the lab's findings JSON).
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .bounded import LIMIT, cut, run_bounded
from .contract import Contract, EditRefused


class Workspace:
    def __init__(self, repo, contract: Contract, limit: int = LIMIT):
        self.repo, self.contract, self.limit = Path(repo).resolve(), contract, limit
        self._dir = Path(tempfile.mkdtemp(prefix="ouro-agent-"))
        self.root = self._dir / "tree"
        self._git("worktree", "add", "--detach", str(self.root), "HEAD", cwd=self.repo)
        self.edits: list[dict] = []      # path, risk classes, per edit

    def _git(self, *args, cwd=None) -> str:
        p = subprocess.run(["git", *args], cwd=cwd or self.root, capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"git {' '.join(args)}: {p.stderr.strip()}")
        return p.stdout

    def close(self) -> None:
        try:
            self._git("worktree", "remove", "--force", str(self.root), cwd=self.repo)
        except RuntimeError:
            pass
        shutil.rmtree(self._dir, ignore_errors=True)

    def _path(self, rel: str) -> Path:
        p = (self.root / rel).resolve()
        if self.root.resolve() not in p.parents and p != self.root.resolve():
            raise EditRefused(f"{rel} is outside the workspace")
        return p

    # ---- reading ----
    def list_files(self, glob: str = "**/*.py") -> str:
        files = sorted(str(p.relative_to(self.root)) for p in self.root.glob(glob) if p.is_file() and ".git" not in p.parts)
        return cut("\n".join(files) + f"\n[{len(files)} files match {glob!r}]", self.limit)

    def read_file(self, path: str, start: int = 1, count: int = 200) -> str:
        try:
            lines = self._path(path).read_text().splitlines()
        except (OSError, EditRefused) as e:
            return f"cannot read {path}: {e}"
        start = max(1, start)
        window = lines[start - 1:start - 1 + count]
        body = "\n".join(f"{i:5d}  {line}" for i, line in enumerate(window, start))
        return cut(body + f"\n[{path}: lines {start}..{start + len(window) - 1} of {len(lines)}]", self.limit)

    def search(self, pattern: str, glob: str = "**/*.py", max_hits: int = 200) -> str:
        try:
            rx = re.compile(pattern)
        except re.error as e:
            return f"not a regular expression: {e}"
        hits = []
        for p in sorted(self.root.glob(glob)):
            if not p.is_file() or ".git" in p.parts:
                continue
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
                if rx.search(line):
                    hits.append(f"{p.relative_to(self.root)}:{i}: {line.strip()}")
        shown = hits[:max_hits]
        more = f"\n[{len(hits)} matches; the first {max_hits} shown]" if len(hits) > max_hits else f"\n[{len(hits)} matches]"
        return cut("\n".join(shown) + more, self.limit)

    # ---- changing ----
    def edit(self, path: str, old: str, new: str) -> str:
        """Replace the one occurrence of `old` in `path` with `new`; the observation says what
        was refused and why, or which risk classes the change falls in."""
        try:
            self.contract.check_edit(path)
            target = self._path(path)
        except EditRefused as e:
            return f"refused: {e}"
        if not target.exists():
            return f"refused: {path} does not exist (edits change existing files)"
        text = target.read_text()
        n = text.count(old) if old else 0
        if n != 1:
            return f"refused: the text to replace occurs {n} times in {path}; it must occur exactly once"
        after = text.replace(old, new, 1)
        if path.endswith(".py"):
            try:
                ast.parse(after)
            except SyntaxError as e:
                return f"refused: {path} would no longer parse (line {e.lineno}: {e.msg}); nothing was written"
        target.write_text(after)
        changed = [line for line in old.splitlines() + new.splitlines()]
        risks = self.contract.risk_classes(path, changed)
        self.edits.append({"path": path, "risk": risks})
        return f"edited {path}" + (f"; risk classes: {', '.join(risks)} (needs a person's review)" if risks else "")

    def diff(self) -> str:
        return cut(self._git("diff") or "[no changes]", self.limit)

    def full_diff(self, since: str | None = None) -> str:
        """The whole diff, uncut: the working change, or everything since commit `since`."""
        return self._git("diff", since) if since else self._git("diff")

    def changed_files(self) -> list[str]:
        return [l for l in self._git("diff", "--name-only").splitlines() if l]

    def head(self) -> str:
        return self._git("rev-parse", "HEAD").strip()

    def commit(self, message: str) -> str:
        """Keep the working change: a commit on the worktree's detached HEAD (the user's branches
        never move); later diffs and reverts are against it."""
        self._git("-c", "user.name=ouro agent", "-c", "user.email=agent@ouro.invalid", "commit", "-q", "-a",
                  "--no-verify", "-m", message)
        self.edits = []
        return self.head()

    def revert(self, path: str | None = None) -> str:
        self._git("checkout", "--", path or ".")
        self.edits = [e for e in self.edits if path is not None and e["path"] != path]
        return f"reverted {path or 'every change'}"

    # ---- running ----
    def run_tests(self, selection: list[str], timeout_s: float = 900.0) -> str:
        return self.tests(selection, timeout_s).render()

    def tests(self, selection: list[str], timeout_s: float = 900.0):
        """pytest on `selection` in the worktree: the Observation (passed: state done, exit 0)."""
        return run_bounded([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection], cwd=self.root,
                           timeout_s=timeout_s, limit=self.limit, env=_env(self.root))

    def run_probe(self, args: list[str], timeout_s: float = 600.0) -> tuple[str, list[dict]]:
        """`ouro probe ARGS` in the workspace; (observation, findings)."""
        out = self._dir / "probe.json"
        out.unlink(missing_ok=True)
        obs = run_bounded([sys.executable, "-m", "ouro.cli", "probe", *args, "--json", str(out)], cwd=self.root,
                          timeout_s=timeout_s, limit=self.limit, env=_env(self.root))
        findings = json.loads(out.read_text())["findings"] if out.exists() else []
        brief = [{k: f.get(k) for k in ("severity", "summary", "where", "measured", "expected", "next")} for f in findings]
        return cut(obs.render() + "\nfindings: " + json.dumps(brief), self.limit), findings


def _env(root: Path) -> dict:
    import os
    return dict(os.environ, PYTHONPATH=str(root))
