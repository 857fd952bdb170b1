"""What a run is for, read from the contract: the sentence the model is given, the measurement
its A/B benchmark compares, and (for a budget) the check that says when it is met.

Under sparse feedback every goal is measured the way a team without the lab measures: the
tests pass or fail, and end-to-end throughput (the `offline` scenario's tokens per second).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Goal:
    kind: str                     # budget, metric or probe
    text: str
    scenario: str
    metric: str
    direction: str                # lower or higher is better
    check: str | None = None      # a budget's check
    probe: list = field(default_factory=list)

    @classmethod
    def from_contract(cls, contract, feedback: str = "dense") -> "Goal":
        g, b = contract.goal, contract.bench
        if feedback == "sparse":
            return cls(g["kind"], "make the tests pass and end-to-end throughput higher, without breaking anything",
                       "offline", "offline_tok_s", "higher")
        if g["kind"] == "metric":
            return cls("metric", f"make {g['metric']} of the {g['scenario']} scenario {g['direction']}",
                       g["scenario"], g["metric"], g["direction"])
        if g["kind"] == "probe":
            return cls("probe", f"make `ouro probe {' '.join(g['probe'])}` report no warnings or errors, "
                       "without making the code slower", b["scenario"], b["metric"], b["direction"],
                       probe=list(g["probe"]))
        import ast
        from ..lab.budgets import default_path, load_budgets, names_in, parse_check
        budget = next((x for x in load_budgets(default_path()) if x["name"] == g["budget"]), None)
        if budget is None:
            raise ValueError(f"the contract's budget {g['budget']!r} is not in {default_path()}")
        check = parse_check(budget["check"]).body            # "left <= right": left is what to move
        metric = names_in(ast.unparse(check.left))[0]
        direction = "lower" if isinstance(check.ops[0], (ast.Lt, ast.LtE)) else "higher"
        return cls("budget", f"make the budget {budget['name']!r} pass: {budget['check']}",
                   budget["scenario"], metric, direction, check=budget["check"])

    def met_by(self, measurements: dict) -> bool | None:
        """A budget's check on these measurements (None for other goals)."""
        if self.check is None:
            return None
        from ..lab.budgets import evaluate
        return bool(evaluate(self.check, measurements))
