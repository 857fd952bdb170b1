"""One side of the agent's A/B benchmark: `python -m ouro.agent.ab_worker MODEL_DIR`, run with
the tree under test first on PYTHONPATH. It loads once, then answers each stdin line (a lab
scenario's name) with one JSON line of that scenario's measurements, so the harness can
alternate the two sides repeat by repeat without paying a process start for each."""

from __future__ import annotations

import json
import sys


def main() -> int:
    from ouro.lab.budgets import measure
    model_dir = sys.argv[1]
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        scenario = line.strip()
        if not scenario:
            continue
        try:
            r = measure(scenario, model_dir)
            print(json.dumps({"measurements": r["measurements"]}), flush=True)
        except Exception as e:        # the tree under test is broken: say so, keep the protocol
            print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
