"""`ouro agent ...`: the Infra Agent's commands (so far: `init`, which writes the contract)."""

from __future__ import annotations

import sys


def add_agent_parser(sub) -> None:
    ag = sub.add_parser("agent", help="the Infra Agent (so far: `ouro agent init` writes its contract)")
    cmds = ag.add_subparsers(dest="agent_cmd", required=True)
    init = cmds.add_parser("init", help="write a commented agent.toml: goal, writable and frozen paths, risk classes, limits")
    init.add_argument("--path", default="agent.toml")
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    init.set_defaults(func=_cmd_init)


def _cmd_init(args) -> int:
    from .contract import write_default
    try:
        path = write_default(args.path, args.force)
    except FileExistsError as e:
        print(f"ouro: error: {e}", file=sys.stderr)
        return 2
    print(f"ouro: wrote {path}: edit its [goal] and [paths] before running the agent")
    return 0
