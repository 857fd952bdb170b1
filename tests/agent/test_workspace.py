"""The agent's workspace on a real git repository: edits land in a detached worktree (the user's
tree stays as it was), a frozen or non-writable path is refused, an edit that breaks parsing or
whose snippet is missing or repeated is refused with nothing written, risk classes are named,
diff and revert work, reads and searches are windowed and bounded, and tests run in the worktree
with their state and exit code."""

import subprocess

import pytest

from ouro.agent.contract import Contract
from ouro.agent.workspace import Workspace

pytestmark = pytest.mark.processes

CONTRACT = {"goal": {"kind": "budget", "budget": "b"},
            "paths": {"writable": ["pkg/**"], "frozen": ["tests/**", "pkg/reference.py"]},
            "risk": {"numerics": ["float16|tf32"], "async": ["threading"], "production": ["pkg/server.py"]}}


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    (r / "pkg").mkdir(parents=True)
    (r / "tests").mkdir()
    (r / "pkg" / "fast.py").write_text("def add(a, b):\n    return a + b\n")
    (r / "pkg" / "reference.py").write_text("def add(a, b):\n    return a + b\n")
    (r / "pkg" / "server.py").write_text("PORT = 8000\n")
    (r / "tests" / "test_fast.py").write_text("from pkg.fast import add\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    for cmd in (["init", "-q"], ["add", "-A"], ["-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "start"]):
        subprocess.run(["git", *cmd], cwd=r, check=True)
    return r


@pytest.fixture
def ws(repo):
    w = Workspace(repo, Contract.from_dict(CONTRACT))
    yield w
    w.close()


def test_edits_stay_in_the_worktree_and_follow_the_contract(repo, ws):
    assert ws.edit("pkg/fast.py", "return a + b", "return b + a") == "edited pkg/fast.py"
    assert (repo / "pkg" / "fast.py").read_text().endswith("return a + b\n")          # the user's tree
    assert "+    return b + a" in ws.diff()
    assert ws.edit("tests/test_fast.py", "== 5", "== 6").startswith("refused: tests/test_fast.py is frozen")
    assert "frozen" in ws.edit("pkg/reference.py", "a + b", "b + a")
    assert "outside the writable" in ws.edit("README.md", "x", "y")
    assert "outside the repository" in ws.edit("pkg/../../escape.py", "x", "y")
    assert "frozen" in ws.edit("pkg/../tests/test_fast.py", "== 5", "== 6")            # no way round by ..
    assert "no longer parse" in ws.edit("pkg/fast.py", "return b + a", "return (b + a")
    assert ws.read_file("pkg/fast.py").count("return b + a") == 1                     # nothing written
    assert "occurs 0 times" in ws.edit("pkg/fast.py", "not there", "x")
    risky = ws.edit("pkg/fast.py", "return b + a", "return (b + a).to(torch.float16)")
    assert "risk classes: numerics" in risky
    assert "production" in ws.edit("pkg/server.py", "8000", "8001")


def test_revert_and_windows(ws):
    ws.edit("pkg/fast.py", "return a + b", "return b + a")
    assert ws.revert() == "reverted every change" and ws.diff() == "[no changes]"
    window = ws.read_file("pkg/fast.py", start=2, count=1)
    assert "    2      return a + b" in window and "lines 2..2 of 2" in window
    assert "pkg/fast.py:2:" in ws.search(r"return a \+ b") and "[2 matches]" in ws.search(r"return a \+ b")
    assert "tests/test_fast.py" in ws.list_files() and "not a regular expression" in ws.search("(")


def test_tests_run_in_the_worktree_and_report_their_state(ws):
    ok = ws.run_tests(["tests"])
    assert ok.startswith("[done, exit 0") and "1 passed" in ok
    ws.edit("pkg/fast.py", "return a + b", "return a - b")
    bad = ws.run_tests(["tests"])
    assert bad.startswith("[done, exit 1") and "1 failed" in bad
