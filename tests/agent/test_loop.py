"""The Infra Agent's loop end to end against a real HTTP endpoint that replays a scripted
conversation, on real copies of this checkout (their own git repositories):
- a run fixes a planted fault (edit, tests, probe, benchmark, keep) and the eval scores it solved;
- an edit that breaks correctness is reverted;
- edits of frozen files are refused;
- a change touching precision is parked, and `ouro agent review` shows and applies it;
- a run against a real `ouro serve` of `tiny`, whose replies are not tool calls, ends cleanly.
Every run's journal is read back whole, and each must hold every field its decisions need."""

import json
import subprocess
import tomllib

import pytest
from tests.helpers.scripted_llm import ScriptedEndpoint, call

from ouro.agent.contract import DEFAULT, Contract
from ouro.agent.journal import FIELDS, read
from ouro.agent.llm import LLMClient
from ouro.agent.loop import AgentRun
from ouro.lab.call_trace import REPO_DIR
from ouro.lab.faults.patch import apply_fault, copy_tree
from ouro.lab.faults import all_faults

pytestmark = pytest.mark.processes

FAULTS = {f.name: f for f in all_faults()}
KDA_TESTS = ["tests/ops/test_kda.py", "-k", "recurrent"]


@pytest.fixture
def endpoint():
    e = ScriptedEndpoint()
    yield e
    e.close()


def git(root, *args):
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout


def make_repo(tmp_path, fault=None):
    root = copy_tree(REPO_DIR, str(tmp_path / "repo"))
    if fault:
        apply_fault(root, FAULTS[fault])
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "start")
    return root


def contract(goal, tests=KDA_TESTS, heldout=0, repeats=2, iterations=5):
    doc = tomllib.loads(DEFAULT)
    doc["goal"] = goal
    doc["checks"] = {"tests": tests, "heldout": heldout}
    doc["bench"].update(repeats=repeats)
    doc["limits"].update(iterations=iterations, tool_seconds=300)
    return Contract.from_dict(doc)


DECODE_GOAL = {"kind": "metric", "metric": "decode_step_ms", "direction": "lower", "scenario": "decode"}


def journal(out):
    rows = read(f"{out.run_dir}/journal.jsonl")
    assert all(set(FIELDS) <= set(r) for r in rows)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert rows[0]["measurement"]["measurements"]["decode_step_ms"] > 0          # the baseline
    assert rows[-1]["decision"] == "stopped" and rows[-1]["next"] == out.reason
    md = open(f"{out.run_dir}/journal.md").read()
    assert md.count("## Step ") == len(rows)
    for r in rows:
        assert isinstance(r["tokens"], int) and r["seconds"] >= 0
        if r["decision"] in ("kept", "reverted", "parked"):
            assert r["hypothesis"] and r["change"].startswith("diff --git") and r["correctness"]["tests"]
    return rows


@pytest.mark.slow
def test_a_run_fixes_a_planted_fault_end_to_end(endpoint, tmp_path):
    from ouro.agent.eval import format_rows, run_eval
    fault = FAULTS["recurrent_step_beta_scaled"]
    bad = fault.replace[0][1].split("  # FAULT")[0]
    path, probe = fault.file, fault.probes[0]
    endpoint.script += [
        call("hypothesis", question="why does decode disagree with prefill?",
             hypothesis="the recurrent step scales its delta-rule update", check="read kda_recurrent_step"),
        call("search", pattern=r"0\.9 \* beta", glob="ouro/ops/**/*.py"),
        call("edit", path=path, old=bad + "  # FAULT", new=fault.replace[0][0]),
        call("run_tests", tests=KDA_TESTS),
        call("run_probe", args=probe),
        call("run_benchmark"),
        call("submit", summary="the recurrent step applies beta once"),
        call("finish", summary="fixed"),
    ]
    rows = run_eval([fault], lambda: LLMClient(endpoint.url, "scripted"), "dense", tests=KDA_TESTS,
                    score_tests=KDA_TESTS, heldout=1, repeats=2, workdir=str(tmp_path), timeout=300)
    table = format_rows(rows)
    r = rows[0]
    assert r["solved"] and r["decisions"] == ["kept"] and r["tests"] == "pass" and not r["probe_fires"], table
    results = endpoint.tool_results()
    assert "ouro/ops/kda/recurrent.py:" in results[1] and results[2] == f"edited {path}"
    assert results[3].startswith("[done, exit 0") and "passed" in results[3]
    assert '"severity": "info"' in results[4] or "findings: []" in results[4]
    assert "decode_step_ms" in results[5] and "pairs" in results[5]
    verdict = json.loads(results[6])
    assert verdict["decision"] == "kept" and verdict["measurement"]["probe"]["before"] >= 1
    assert verdict["measurement"]["probe"]["after"] == 0 and verdict["correctness"]["heldout"]["passed"]
    held = verdict["correctness"]["heldout"]["cases"][0]
    assert held["seed"] and held["prompt_len"] and held["config"]
    rows_j = journal(type("O", (), {"run_dir": r["journal"].rsplit("/", 1)[0], "reason": r["ended"]}))
    kept = [x for x in rows_j if x["decision"] == "kept"]
    removed = [l for l in kept[0]["change"].splitlines() if l.startswith("-") and bad.strip() in l]
    assert len(kept) == 1 and removed and kept[0]["question"].startswith("why does decode")
    assert "fixed" in r["ended"] and "1/1 solved" in table


@pytest.mark.slow
def test_edits_that_break_correctness_are_reverted(endpoint, tmp_path):
    """One the contract's tests catch, and one they miss that the held-out sweep catches."""
    repo = make_repo(tmp_path)
    line = FAULTS["recurrent_step_beta_scaled"].replace[0][0]
    mlp = "gate, up = project(x, self.gate_proj, self.up_proj)"      # MLP.forward: both of its paths
    endpoint.script += [
        call("hypothesis", hypothesis="halving the update is free speed"),
        call("edit", path="ouro/ops/kda/recurrent.py", old=line, new=line.replace("u = beta", "u = 0.5 * beta")),
        call("submit", summary="cheaper update"),
        call("diff"),
        call("hypothesis", hypothesis="the shared expert's output can be damped"),
        call("edit", path="ouro/layers/moe.py", old=mlp, new=mlp.replace("project(x,", "project(0.9 * x,")),
        call("run_tests", tests=KDA_TESTS),
        call("submit", summary="damped"),
        call("finish", summary="nothing else"),
    ]
    out = AgentRun(repo, contract(DECODE_GOAL, heldout=1), LLMClient(endpoint.url, "scripted"), seed=1).run()
    results = endpoint.tool_results()
    assert out.decisions == ["reverted", "reverted"] and open(out.final_patch).read() == ""
    verdict = json.loads(results[2].split("\n[done")[0])
    assert verdict["decision"] == "reverted" and verdict["correctness"]["tests"] == "failed"
    assert "failed" in results[2]                                      # the model sees the failing test
    assert results[3] == "[no changes]"                                # the tree is back at the kept state
    assert results[6].startswith("[done, exit 0")                      # the tests miss the second edit ...
    verdict = json.loads(results[7].split("\n[{")[0])
    held = verdict["correctness"]["heldout"]                           # ... the held-out sweep does not
    assert verdict["correctness"]["tests"] == "passed" and not held["passed"] and held["cases"][0]["findings"]
    assert "held-out" in verdict["why"] and verdict["measurement"] is None      # reverted before measuring
    rows = journal(out)
    assert [x["decision"] for x in rows] == ["none", "reverted", "reverted", "stopped"]
    assert git(repo, "status", "--porcelain") == ""                   # the user's tree is untouched


def test_edits_of_frozen_files_are_refused(endpoint, tmp_path):
    repo = make_repo(tmp_path)
    endpoint.script += [
        call("edit", path="tests/ops/test_kda.py", old="import torch", new="import torch  # looser"),
        call("edit", path="ouro/lab/numerics/tolerances.py", old="\n", new="\n\n"),
        call("edit", path="ouro/ops/../../budgets/default.toml", old="<=", new=">="),
        call("edit", path="ouro/ops/../../../escape.py", old="a", new="b"),
        call("submit", summary="nothing"),
        call("finish", summary="stopping"),
    ]
    out = AgentRun(repo, contract(DECODE_GOAL), LLMClient(endpoint.url, "scripted"), seed=1).run()
    results = endpoint.tool_results()
    assert all(r.startswith("refused") for r in results[:4]), results
    assert all("frozen" in r for r in results[:3]) and "outside the repository" in results[3]
    assert results[4].startswith("nothing to submit")
    rows = journal(out)
    assert [x["decision"] for x in rows] == ["none"] + ["refused"] * 4 + ["stopped"]
    assert out.iterations == 0 and open(out.final_patch).read() == ""
    assert git(repo, "status", "--porcelain") == ""


@pytest.mark.slow
def test_a_change_touching_precision_is_parked_for_review(endpoint, tmp_path):
    from ouro.cli import main
    fault = FAULTS["tf32_kda_state_matmul"]
    repo = make_repo(tmp_path, fault.name)
    faulted = open(f"{repo}/{fault.file}").read()
    start = faulted.index("tf32 = lambda")
    block = faulted[start:faulted.index("tf32(u)", start) + len("tf32(u)")]
    endpoint.script += [
        call("hypothesis", hypothesis="the state update's matmul is rounded to TF32"),
        call("edit", path=fault.file, old=block, new=fault.replace[0][0]),
        call("submit", summary="the state update in full float32"),
        call("diff"),
        call("finish", summary="parked for a person"),
    ]
    goal = {"kind": "probe", "probe": fault.probes[0]}
    out = AgentRun(repo, contract(goal), LLMClient(endpoint.url, "scripted"), seed=2).run()
    verdict = json.loads(endpoint.tool_results()[2])
    assert out.decisions == ["parked"] and verdict["decision"] == "parked", verdict
    assert "numerics" in verdict["why"] and verdict["measurement"]["probe"]["after"] == 0
    assert endpoint.tool_results()[3] == "[no changes]" and open(out.final_patch).read() == ""
    rows = journal(out)
    assert [x["decision"] for x in rows] == ["none", "parked", "stopped"]
    assert open(f"{repo}/{fault.file}").read() == faulted                # untouched until a person accepts
    run = ["agent", "review", "--repo", repo, "--run", out.run_id]
    assert main(run) == 0
    assert main(run + ["--drop", "7"]) == 2                             # no such change: a clear error
    assert main(run + ["--apply", "1"]) == 0
    assert "tf32 = lambda" not in open(f"{repo}/{fault.file}").read()
    assert main(run + ["--apply", "1"]) == 2                            # applied already
    doc = json.load(open(f"{out.run_dir}/parked/1.json"))
    assert doc["status"] == "applied" and doc["risk"] == ["numerics"] and doc["correctness"]["tests"] == "passed"


@pytest.mark.slow
def test_a_real_ouro_serve_whose_replies_are_not_tool_calls_ends_cleanly(tmp_path, tiny_checkpoint):
    from tests.helpers.serve_helpers import Server
    repo = make_repo(tmp_path)
    server = Server(tiny_checkpoint, "--max-model-len", "8192", "--served-model-name", "tiny", tmp_path=tmp_path)
    try:
        llm = LLMClient(server.base + "/v1", "tiny", max_tokens=16)
        out = AgentRun(repo, contract(DECODE_GOAL), llm, seed=3).run()
    finally:
        server.stop()
    assert "replies in a row were not usable tool calls" in out.reason and out.invalid_replies == 3
    assert out.iterations == 0 and out.tokens > 0 and open(out.final_patch).read() == ""
    rows = journal(out)
    assert [x["decision"] for x in rows] == ["none", "stopped"]
    assert rows[-1]["measurement"]["invalid_replies"] == 3
    assert git(repo, "status", "--porcelain") == "" and len(git(repo, "worktree", "list").splitlines()) == 1


@pytest.mark.slow
def test_sparse_feedback_through_the_cli_hides_the_lab(endpoint, tmp_path):
    """`ouro agent run --feedback sparse`: no probe tool, and tests say only pass or fail."""
    from ouro.agent.review import latest_run
    from ouro.cli import main
    repo = make_repo(tmp_path)
    text = DEFAULT.replace('tests = ["tests/ops/test_kda.py", "tests/ops/test_dsa.py", "tests/ops/test_moe.py", '
                           '"tests/engine/test_engine.py"]', f"tests = {json.dumps(KDA_TESTS)}")
    assert text != DEFAULT
    (tmp_path / "agent.toml").write_text(text.replace("heldout = 2", "heldout = 0"))
    endpoint.script += [call("run_probe", args=["redundancy", "--model", "tiny"]),
                        call("run_tests", tests=KDA_TESTS), call("finish", summary="done")]
    assert main(["agent", "run", "--endpoint", endpoint.url, "--model", "scripted", "--repo", repo,
                 "--contract", str(tmp_path / "agent.toml"), "--feedback", "sparse", "--iterations", "2"]) == 0
    names = {t["function"]["name"] for t in endpoint.seen[0]["tools"]}
    assert "run_probe" not in names and {"run_tests", "run_benchmark", "submit", "edit"} <= names
    assert "no tool 'run_probe'" in endpoint.seen[1]["messages"][-1]["content"]      # the correction
    assert endpoint.tool_results() == ["tests: passed"]
    start = endpoint.seen[0]["messages"][1]["content"]
    assert "offline_tok_s" in start and "tests: passed" in start and "finding" not in start
    rows = read(f"{latest_run(repo)}/journal.jsonl")
    assert [x["decision"] for x in rows] == ["none", "stopped"] and rows[-1]["measurement"]["invalid_replies"] == 1
    assert main(["agent", "review", "--repo", repo]) == 0
