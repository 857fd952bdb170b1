"""The Infra Agent's contract and bounded observations: `ouro agent init` writes a contract that
loads; frozen paths are refused (frozen wins over writable), paths outside the writable ones too;
risk classes are found by path and by the changed lines' text; malformed contracts name what is
wrong; a command printing 50 MB comes back cut, with its size, and one that hangs comes back
timed out."""

import sys

import pytest

from ouro.agent.bounded import LIMIT, cut, run_bounded
from ouro.agent.contract import Contract, ContractError, EditRefused
from ouro.cli import main


@pytest.fixture
def contract(tmp_path):
    path = tmp_path / "agent.toml"
    assert main(["agent", "init", "--path", str(path)]) == 0
    assert main(["agent", "init", "--path", str(path)]) == 2          # no silent overwrite
    return Contract.load(path)


def test_edits_inside_the_writable_paths_only_and_never_frozen(contract):
    contract.check_edit("ouro/disagg/kv_sender.py")
    contract.check_edit("ouro/ops/kda/chunk.py")
    for path, word in [("tests/engine/test_engine.py", "frozen"), ("ouro/lab/numerics/tolerances.py", "frozen"), ("ouro/measure/ab.py", "frozen"),
                       ("budgets/default.toml", "frozen"), ("ouro/ops/kda/naive.py", "frozen"),
                       ("README.md", "outside"), ("ouro/serve/api_server.py", "outside")]:
        with pytest.raises(EditRefused, match=word):
            contract.check_edit(path)


def test_risk_classes_by_path_and_by_changed_text(contract):
    assert contract.risk_classes("ouro/ops/moe/experts.py", ["    w = w.to(torch.bfloat16)"]) == ["numerics"]
    assert contract.risk_classes("ouro/ops/kda/cp.py", ['    return matmul(a, b, "tf32")']) == ["numerics"]
    assert contract.risk_classes("ouro/layers/dsa.py", ["    tol = 1e-3"]) == ["numerics"]
    assert contract.risk_classes("ouro/engine/x.py", ["@functools.lru_cache(maxsize=None)"]) == ["numerics"]
    assert contract.risk_classes("ouro/disagg/kv_sender.py", ["        t = threading.Thread(target=f)"]) == ["async"]
    assert contract.risk_classes("ouro/engine/scheduler.py", ["    n = min(a, b)"]) == ["production"]
    assert contract.risk_classes("ouro/ops/moe/route.py", ["    k = min(k, n)"]) == []


@pytest.mark.parametrize("doc,word", [
    ({"goal": {"kind": "vibes"}, "paths": {"writable": ["x"]}}, "kind"),
    ({"goal": {"kind": "budget"}, "paths": {"writable": ["x"]}}, "budget"),
    ({"goal": {"kind": "metric", "metric": "m", "scenario": "s", "direction": "up"}, "paths": {"writable": ["x"]}},
     "direction"),
    ({"goal": {"kind": "budget", "budget": "b"}, "paths": {"writable": []}}, "writable"),
    ({"goal": {"kind": "budget", "budget": "b"}, "paths": {"writable": ["x"]}, "risk": {"numerics": ["(unclosed"]}},
     "regular expression"),
    ({"goal": {"kind": "budget", "budget": "b"}, "paths": {"writable": ["x"]}, "limits": {"tokens": -1}}, "tokens"),
    # a misspelt key or table is refused, not dropped with its default left in force
    ({"goal": {"kind": "budget", "budget": "b"}, "paths": {"writable": ["x"]}, "limits": {"iteratons": 3}},
     "no key 'iteratons'"),
    ({"goal": {"kind": "budget", "budget": "b"}, "paths": {"writable": ["x"]}, "limit": {"iterations": 3}},
     "'limit' is not a table"),
    ({"goal": {"kind": "budget", "budget": "b"}, "paths": {"writable": ["x"], "frozn": ["y"]}}, "no key 'frozn'"),
    ({"goal": {"kind": "budget", "budget": "b", "modle": "tiny"}, "paths": {"writable": ["x"]}}, "no key 'modle'"),
])
def test_malformed_contracts_say_what_is_wrong(doc, word):
    with pytest.raises(ContractError, match=word):
        Contract.from_dict(doc)


@pytest.mark.processes
def test_fifty_megabytes_of_output_come_back_cut_with_their_size():
    obs = run_bounded([sys.executable, "-c", "import sys; sys.stdout.write('a' * 25_000_000 + 'b' * 25_000_000)"])
    assert obs.state == "done" and obs.exit_code == 0 and obs.total_bytes == 50_000_000
    assert len(obs.text) <= LIMIT and obs.text.startswith("a") and obs.text.endswith("b")
    assert "50,000,000 characters in all" in obs.render()
    small = run_bounded([sys.executable, "-c", "print('hi')"])
    assert small.text == "hi\n" and small.total_bytes == 3
    assert cut("x" * 10, 100) == "x" * 10


@pytest.mark.processes
def test_a_command_that_hangs_comes_back_timed_out():
    obs = run_bounded([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(30)"], timeout_s=0.5)
    assert obs.state == "timed-out" and obs.exit_code is None and "started" in obs.text and obs.seconds < 10


def test_journal_appends_parseable_steps_and_a_readable_log(tmp_path):
    from ouro.agent.journal import Journal, read
    j = Journal(tmp_path, "run-1")
    j.record(1, question="why is pd_overhead 0.26?", hypothesis="a loop spins", change="--- a\n+++ b",
             correctness="tests passed", measurement={"pd_overhead": 0.011}, decision="kept", next="stop",
             tokens=1200, seconds=3.5)
    Journal(tmp_path, "run-1").record(2, decision="stopped")            # a second writer appends
    rows = read(tmp_path / "run-1.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["measurement"] == {"pd_overhead": 0.011}
    md = (tmp_path / "run-1.md").read_text()
    assert md.count("# Agent run run-1") == 1 and "## Step 1: kept" in md and "## Step 2: stopped" in md
    with pytest.raises(ValueError, match="decision"):
        j.record(3, decision="maybe")
    with pytest.raises(ValueError, match="fields"):
        j.record(3, mood="good")
    (tmp_path / "run-1.jsonl").write_text((tmp_path / "run-1.jsonl").read_text() + "{broken\n")
    with pytest.raises(ValueError, match="run-1.jsonl:3"):
        read(tmp_path / "run-1.jsonl")
