"""`ouro probe NAME ...` and `ouro lab faults ...`: the command line of the lab. Each probe module
has `add_arguments(parser)` and `run(args) -> list[Finding]`; this file prints their table and
writes `--json FILE`."""

from __future__ import annotations

import importlib
import sys
import time

# probe name -> (module, one-line help)
PROBES = {
    "numerics": ("ouro.lab.numerics.probe", "two configurations on the same inputs, every layer and op tapped"),
    "redundancy": ("ouro.lab.redundancy.probe", "repeated ops on identical inputs, ops per module, host syncs"),
    "timeline": ("ouro.lab.timeline.probe", "spans per thread, overlap, idle gaps, GIL starvation, Chrome trace"),
    "budgets": ("ouro.lab.budgets", "declared constraints over measured scenarios (a TOML file)"),
    "kernels": ("ouro.lab.kernels.probe", "per-op microbenchmarks: correct first, then time, roofline share, Amdahl"),
    "leaks": ("ouro.lab.leaks.probe", "pages and state slots each request path returns, with the path that kept them"),
    "disagg": ("ouro.lab.disagg_check", "prefill/decode handoff under timeouts and aborts: late writes, wrong outputs, leaks"),
    "vision": ("ouro.lab.numerics.vision", "images against transformers: the tower module by module, then the image rows"),
}


def _run_probe(args) -> int:
    from .findings import apply_baseline, format_table, read_json, sort_findings, write_json
    module = importlib.import_module(PROBES[args.probe][0])
    t0 = time.perf_counter()
    findings = module.run(args)
    if args.baseline:
        findings = apply_baseline(findings, read_json(args.baseline))
    findings = sort_findings(findings)
    seconds = time.perf_counter() - t0
    print(format_table(findings))
    print(f"\n{args.probe}: {len(findings)} finding(s) in {seconds:.1f} s")
    if args.json:
        write_json(findings, args.json, {"probe": args.probe, "seconds": seconds})
    worst = max((f.rank for f in findings), default=-1)
    if args.fail_on and worst >= ("info", "warning", "error").index(args.fail_on):
        return 1
    return 0


def add_probe_parser(sub, with_options: str | None = None) -> None:
    """Only the named probe's module is imported for its options (`ouro serve` and the other
    probes need not import it); the others are registered by name."""
    pr = sub.add_parser("probe", help="dense-feedback probes: findings that say where a problem is")
    kinds = pr.add_subparsers(dest="probe", required=True)
    for name, (mod, help_text) in PROBES.items():
        p = kinds.add_parser(name, help=help_text)
        p.add_argument("--json", default=None, metavar="FILE", help='write {"findings": [...]} to FILE')
        p.add_argument("--fail-on", default=None, choices=["warning", "error"],
                       help="exit 1 when a finding this severe or worse is made")
        p.add_argument("--baseline", default=None, metavar="FILE",
                       help="findings JSON of a known-good run: findings it already had become info")
        if with_options == name:
            importlib.import_module(mod).add_arguments(p)
        p.set_defaults(func=_run_probe)


def _run_faults(args) -> int:
    from .faults.suite import run_suite
    return run_suite(args)


def add_lab_parser(sub) -> None:
    lab = sub.add_parser("lab", help="the lab's fault suite (planted bugs that score the probes) and policy searches")
    kinds = lab.add_subparsers(dest="lab_command", required=True)
    f = kinds.add_parser("faults", help="apply each planted fault to a copy of ouro, run the probes, score them")
    f.add_argument("--only", default=None, help="comma-separated fault names (default: all)")
    f.add_argument("--list", action="store_true", help="list the faults and exit")
    f.add_argument("--json", default=None, metavar="FILE", help='write {"faults": [...]} to FILE')
    f.add_argument("--sparse", action="store_true",
                   help="also run the sparse baseline per fault: the default test suite and the throughput change")
    f.add_argument("--timeout", type=float, default=120.0, help="seconds per probe run before it counts as a miss")
    f.add_argument("--no-clean", action="store_true",
                   help="skip running the same probes on an unpatched copy (the false-alarm check)")
    f.set_defaults(func=_run_faults)
    from . import quant_policy
    q = kinds.add_parser("quant-policy", help="the cheapest per-layer W8A8 policy within a held-out bits/byte budget")
    quant_policy.add_arguments(q)
    q.set_defaults(func=quant_policy.run)


if __name__ == "__main__":
    sys.exit(0)
