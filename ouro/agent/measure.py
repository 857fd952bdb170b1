"""What a submitted change is judged by. Everything here is frozen code (ouro/agent, ouro/lab)
running in separate processes, so the agent's edits cannot reach the timer or the inputs.

- `ab_benchmark`: the agent's tree against the tree it started from, one long-lived worker per
  side (`ab_worker`), repeats alternating A B / B A, medians, a bootstrap interval and a noise
  estimate (the lab's `verdict_from_times`); a change smaller than the noise is "no difference".
- `heldout_sweep`: ouro against the transformers reference (`ouro probe numerics`), on a seed,
  a prompt length and a serving configuration drawn when the change is submitted, so no test
  the agent has seen can be what passes.
"""

from __future__ import annotations

import json
import os
import random
import select
import statistics
import subprocess
import sys
import time

from ..measure.ab import verdict_from_times


MIN_PAIRS = 3


class BenchError(RuntimeError):
    """A side of the benchmark failed or did not answer in time."""


class _Side:
    def __init__(self, root: str, model_dir: str, label: str):
        env = dict(os.environ, PYTHONPATH=str(root), OMP_WAIT_POLICY="PASSIVE")
        self.label = label
        self.proc = subprocess.Popen([sys.executable, "-m", "ouro.agent.ab_worker", str(model_dir)], cwd=root,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, start_new_session=True)

    def _line(self, deadline: float) -> dict:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"the {self.label} side did not answer in time")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    raise BenchError(f"the {self.label} side exited (code {self.proc.poll()})")
                doc = json.loads(line)
                if "error" in doc:
                    raise BenchError(f"the {self.label} side failed: {doc['error']}")
                return doc

    def ready(self, deadline: float) -> None:
        self._line(deadline)

    def ask(self, scenario: str, deadline: float) -> dict:
        self.proc.stdin.write(scenario + "\n")
        self.proc.stdin.flush()
        return self._line(deadline)["measurements"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def ab_benchmark(base_root, cand_root, model_dir, scenario: str, metric: str, direction: str = "lower",
                 repeats: int = 5, timeout_s: float = 600.0, min_effect: float = 0.02) -> dict:
    """The candidate tree (B) against the baseline (A) on one measurement of a lab scenario. One
    warm-up pair is thrown away. The verdict is "better", "worse" or "no difference" in the
    measurement's own direction."""
    deadline = time.monotonic() + timeout_s
    sides = {"baseline": _Side(base_root, model_dir, "baseline"), "candidate": _Side(cand_root, model_dir, "candidate")}
    every = {"baseline": {}, "candidate": {}}      # every measurement of the scenario, for a budget's check
    try:
        for s in sides.values():
            s.ready(deadline)
        for i in range(repeats + 1):
            order = ("baseline", "candidate") if i % 2 == 0 else ("candidate", "baseline")
            for name in order:
                m = sides[name].ask(scenario, deadline)
                if metric not in m:
                    raise BenchError(f"scenario {scenario!r} measures {', '.join(sorted(m))}, not {metric!r}")
                if i:
                    for k, x in m.items():
                        every[name].setdefault(k, []).append(float(x))
    finally:
        for s in sides.values():
            s.close()
    values = {side: every[side][metric] for side in every}
    # the verdict helper compares times (lower is better): a "higher" measurement compares inverses
    key = (lambda x: x) if direction == "lower" else (lambda x: 1.0 / x if x else float("inf"))
    v = verdict_from_times([key(x) for x in values["baseline"]], [key(x) for x in values["candidate"]],
                           "baseline", "candidate", min_effect=min_effect)
    # a bootstrap over one or two pairs is their range, not an interval: too few to tell a change from noise
    word = {"faster": "better", "slower": "worse"}.get(v.verdict, "no difference") if repeats >= MIN_PAIRS \
        else "no difference"
    base_med, cand_med = statistics.median(values["baseline"]), statistics.median(values["candidate"])
    return {"scenario": scenario, "metric": metric, "direction": direction, "baseline": base_med,
            "candidate": cand_med, "ratio": cand_med / base_med if base_med else None,
            "interval": [round(v.low, 4), round(v.high, 4)], "noise": round(v.noise, 4), "pairs": repeats,
            "verdict": word, "medians": {side: {k: statistics.median(xs) for k, xs in d.items()}
                                         for side, d in every.items()},
            "text": f"{metric} {base_med:.4g} -> {cand_med:.4g} ({direction} is better): {word} "
                    f"(interval of the ratio {v.low:.3f}..{v.high:.3f}, noise {v.noise:.1%}, {repeats} pairs)"}


CONFIGS = ("mode=prefill", "mode=decode", "chunk={chunk}", "prefix=hit", "batch=2", "mode=decode,chunk={chunk}")


def draw_heldout(count: int, rng: random.Random) -> list[dict]:
    """`count` held-out cases: a configuration, a seed and a prompt length each."""
    out = []
    for _ in range(count):
        cfg = rng.choice(CONFIGS).format(chunk=rng.randint(5, 31))
        low = 40 if "prefix=hit" in cfg else 16
        out.append({"config": cfg, "seed": rng.randint(1, 1_000_000), "prompt_len": rng.randint(low, 96)})
    return out


def heldout_sweep(root, model: str, cases: list[dict], timeout_s: float = 600.0) -> dict:
    """Each case as `ouro probe numerics --a impl=transformers --b CONFIG` in the tree at root;
    it passes when no case reports a warning or an error (or fails to run)."""
    from ..lab.faults.suite import run_probe
    runs, ok = [], True
    for c in cases:
        args = ["numerics", "--model", model, "--a", "impl=transformers", "--b", c["config"],
                "--seed", str(c["seed"]), "--prompt-len", str(c["prompt_len"])]
        findings, seconds, err = run_probe(str(root), args, timeout_s)
        bad = [f for f in findings if f.severity != "info"]
        ok = ok and not bad and not err
        runs.append({**c, "seconds": round(seconds, 1), "error": err,
                     "findings": [f"{f.severity}: {f.summary}" for f in bad][:3]})
    return {"passed": ok, "cases": runs}


def measure_once(root, model_dir, scenario: str, repeats: int = 3, timeout_s: float = 600.0) -> dict:
    """The median of `repeats` runs of a scenario's measurements in one tree (a starting point)."""
    deadline = time.monotonic() + timeout_s
    side = _Side(root, model_dir, "baseline")
    runs = []
    try:
        side.ready(deadline)
        for _ in range(repeats + 1):
            runs.append(side.ask(scenario, deadline))
    finally:
        side.close()
    runs = runs[1:]                                     # the first one warms up
    return {k: statistics.median(float(r[k]) for r in runs) for k in runs[0]}
