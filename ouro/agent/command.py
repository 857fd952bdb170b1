"""`ouro agent ...`: the Infra Agent's commands.

init     write a commented agent.toml (the contract)
run      one run of the loop against an OpenAI-compatible endpoint, in a worktree of this repo
review   show a run's final patch and parked changes with their evidence; apply or drop them
eval     the agent against the lab's planted faults, with dense or sparse feedback
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path


def _endpoint_args(p) -> None:
    p.add_argument("--endpoint", required=True, help="an OpenAI-compatible base URL, e.g. http://127.0.0.1:30000/v1")
    p.add_argument("--model", required=True, help="the served model name the endpoint expects")
    p.add_argument("--api-key-env", default="OURO_AGENT_API_KEY",
                   help="the environment variable holding the key (unset: no key, for a local server)")
    p.add_argument("--max-tokens", type=int, default=None, help="the most tokens one reply may take")
    p.add_argument("--feedback", choices=["dense", "sparse"], default="dense",
                   help="dense: every lab tool; sparse: tests pass/fail and end-to-end throughput only")
    p.add_argument("--iterations", type=int, default=None, help="override the contract's [limits] iterations")
    p.add_argument("--wall-seconds", type=int, default=None, help="override [limits] wall_seconds")
    p.add_argument("--tokens", type=int, default=None, help="override [limits] tokens")


def add_agent_parser(sub) -> None:
    ag = sub.add_parser("agent", help="the Infra Agent: an LLM loop that improves ouro inside a contract")
    cmds = ag.add_subparsers(dest="agent_cmd", required=True)
    init = cmds.add_parser("init", help="write a commented agent.toml: goal, writable and frozen paths, risk classes, limits")
    init.add_argument("--path", default="agent.toml")
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    init.set_defaults(func=_cmd_init)

    run = cmds.add_parser("run", help="run the agent on this repository (in a git worktree; your tree is untouched)")
    _endpoint_args(run)
    run.add_argument("--contract", default="agent.toml")
    run.add_argument("--repo", default=".", help="the git repository to improve (its HEAD is the starting point)")
    run.set_defaults(func=_cmd_run)

    rev = cmds.add_parser("review", help="show a run's final patch and parked changes; apply or drop them")
    rev.add_argument("--repo", default=".")
    rev.add_argument("--run", default=None, help="a run id under runs/agent (default: the latest)")
    act = rev.add_mutually_exclusive_group()
    act.add_argument("--apply", default=None, metavar="N|final", help="apply parked change N, or the final patch")
    act.add_argument("--drop", default=None, metavar="N", help="drop parked change N")
    rev.set_defaults(func=_cmd_review)

    ev = cmds.add_parser("eval", help="score the agent on the lab's planted faults")
    _endpoint_args(ev)
    ev.add_argument("--faults", action="store_true", required=True, help="evaluate on the lab's fault suite")
    ev.add_argument("--only", default=None, help="comma-separated fault names (default: all)")
    ev.add_argument("--tests", type=shlex.split, default=None,
                    help='the contract\'s pytest selection during each run, one string: "tests/ops/test_kda.py -k step"')
    ev.add_argument("--score-tests", type=shlex.split, default=None,
                    help="the pytest selection scored at the end (default: the whole default suite without the lab's)")
    ev.add_argument("--json", default=None, metavar="FILE", help="write the rows as JSON")
    ev.add_argument("--timeout", type=float, default=300.0, help="seconds per scoring probe")
    ev.set_defaults(func=_cmd_eval)


def _limits(args) -> dict:
    return {k: v for k, v in (("iterations", args.iterations), ("wall_seconds", args.wall_seconds),
                              ("tokens", args.tokens)) if v is not None}


def _llm(args):
    from .llm import LLMClient
    return lambda: LLMClient(args.endpoint, args.model, api_key_env=args.api_key_env, max_tokens=args.max_tokens)


def _fail(msg: str) -> int:
    print(f"ouro: error: {msg}", file=sys.stderr)
    return 2


def _cmd_init(args) -> int:
    from .contract import write_default
    try:
        path = write_default(args.path, args.force)
    except FileExistsError as e:
        return _fail(str(e))
    print(f"ouro: wrote {path}: edit its [goal] and [paths] before running the agent")
    return 0


def _repo_root(path: str) -> Path:
    p = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=path, capture_output=True, text=True)
    if p.returncode:
        raise ValueError(f"{path} is not inside a git repository: the agent works in a git worktree of one")
    return Path(p.stdout.strip())


def _cmd_run(args) -> int:
    from .contract import Contract, ContractError
    from .loop import AgentRun
    try:
        repo = _repo_root(args.repo)
        contract = Contract.load(args.contract)
        contract.limits.update(_limits(args))
        run = AgentRun(repo, contract, _llm(args)(), feedback=args.feedback)
    except (ContractError, ValueError) as e:
        return _fail(str(e))
    out = run.run()
    print(f"run {out.run_id}: {out.reason}\n  {out.iterations} submissions {out.decisions}, {out.tokens} tokens, "
          f"{out.seconds} s\n  journal: {out.run_dir}/journal.md\n  next: ouro agent review --run {out.run_id}")
    return 0


def _cmd_review(args) -> int:
    from . import review
    try:
        repo = _repo_root(args.repo)
        run = review.runs_dir(repo) / args.run if args.run else review.latest_run(repo)
        if not (run / "journal.jsonl").exists():
            raise ValueError(f"no agent run {args.run!r} under {review.runs_dir(repo)}")
        if args.apply:
            print(review.apply(repo, run, args.apply))
        elif args.drop:
            print(review.drop(run, args.drop))
        else:
            print(review.show(run))
    except ValueError as e:
        return _fail(str(e))
    return 0


def _cmd_eval(args) -> int:
    from .eval import format_rows, pick_faults, run_eval
    try:
        faults = pick_faults(args.only)
    except ValueError as e:
        return _fail(str(e))
    rows = run_eval(faults, _llm(args), args.feedback, tests=args.tests, score_tests=args.score_tests,
                    limits=_limits(args), timeout=args.timeout)
    print(format_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0
