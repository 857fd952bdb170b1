"""Import layering: every import in `ouro/` and `benchmarks/` against the allowed-imports table of
docs/structure.md, no import circles, no test module imported outside tests/. The mutations (an
upward import, one inside a function, a circle, a unit the table does not name, a benchmark or a
package module importing a test helper) are planted in a copy of the tree and must each be reported
with file and line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers.import_layers import check, read_outside, read_table, table_circles

REPO = Path(__file__).resolve().parent.parent
TABLE = read_table(REPO / "docs" / "structure.md")
OUTSIDE = read_outside(REPO / "docs" / "structure.md")


def test_table_names_every_unit_and_runs_bottom_up():
    units = {p.stem if p.is_file() else p.name for p in (REPO / "ouro").iterdir()
             if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").exists())}
    assert units | {"ouro"} == set(TABLE), "the table and the package's units differ"
    order = list(TABLE)
    for unit, allowed in TABLE.items():
        assert allowed <= set(order[:order.index(unit)]), f"`{unit}` may import a unit of a later row"
    assert not table_circles(TABLE)
    assert "cli" not in set().union(*TABLE.values()), "nothing may import the command line"
    assert {"lab", "agent"}.isdisjoint(set().union(*(TABLE[u] for u in TABLE if u not in ("lab", "agent", "cli"))))
    assert TABLE["measure"] <= {"config"}


def test_ouro_follows_the_table():
    problems = check(REPO, TABLE)
    assert not problems, "\n".join(map(str, problems))


def test_benchmarks_follow_the_table():
    assert OUTSIDE == {"benchmarks": set(TABLE) - {"cli"}}, "benchmarks/ may import every unit but the command line"
    problems = check(REPO, TABLE, OUTSIDE)
    assert not problems, "\n".join(map(str, problems))


@pytest.fixture()
def tree(tmp_path):
    shutil.copytree(REPO / "ouro", tmp_path / "ouro", ignore=shutil.ignore_patterns("__pycache__", "builtin", "*.txt"))
    assert not check(tmp_path, TABLE)
    return tmp_path


def _plant(tree: Path, rel: str, text: str) -> str:
    (tree / rel).write_text(text)
    return rel


@pytest.mark.parametrize("rel, text, line, words", [
    # the engine reaching up into the lab: the import this layering exists to stop
    ("ouro/engine/upward.py", '"""planted"""\nfrom ..lab.findings import Finding\n', 2, "`engine` may not import `lab`"),
    # inside a function counts the same, absolute form too
    ("ouro/measure/upward.py", "def f():\n    import ouro.engine.request\n", 2, "`measure` may not import `engine`"),
    # the command line's defaults are not for the layers below it
    ("ouro/disagg/upward.py", "\n\n\nfrom ouro.cli import DEFAULT_MODEL\n", 4, "`disagg` may not import `cli`"),
    # the user-facing package is not for use inside
    ("ouro/lab/upward.py", "from .. import LLM\n", 1, "`lab` may not import `ouro`"),
    # a package the table does not name
    ("ouro/newunit.py", "from .config import ModelConfig\n", 1, "not in the allowed-imports table"),
])
def test_checker_reports_an_upward_import_with_file_and_line(tree, rel, text, line, words):
    _plant(tree, rel, text)
    problems = check(tree, TABLE)
    assert any(p.path == rel and p.line == line and words in p.message for p in problems), problems


def test_checker_reports_a_circle(tree):
    _plant(tree, "ouro/serve/circle_a.py", "from . import circle_b\n")
    _plant(tree, "ouro/serve/circle_b.py", "x = 1\n\ndef f():\n    from .circle_a import y\n")
    problems = check(tree, TABLE)
    found = [p for p in problems if "import circle of 2 modules" in p.message]
    assert found and {"ouro.serve.circle_a", "ouro.serve.circle_b"} <= set(found[0].message.replace(",", " ").split()), problems
    assert found[0].path.startswith("ouro/serve/circle_")


@pytest.mark.parametrize("rel, text, line, words", [
    # a benchmark reaching into the tests after a sys.path insert (what benchmarks/ did before
    # ouro/lab/reference held the transformers reference harness)
    ("benchmarks/planted.py", 'import sys\nsys.path.insert(0, "tests/helpers")\nfrom numerics import rel_rms\n', 3,
     "`benchmarks` imports the test module `numerics`"),
    # or through the tests package, inside a function
    ("benchmarks/planted.py", "def main():\n    import tests.helpers.numerics\n", 2,
     "`benchmarks` imports the test module `tests.helpers.numerics`"),
    # the package itself may not lean on a test helper either
    ("ouro/lab/planted.py", "from tests.helpers.numerics import rel_rms\n", 1,
     "`lab` imports the test module `tests.helpers.numerics`"),
    # the command line is for users, not for the benchmarks
    ("benchmarks/planted.py", "\nfrom ouro.cli import main\n", 2, "`benchmarks` may not import `cli`"),
], ids=["benchmark-sys-path", "benchmark-tests-package", "package-tests-package", "benchmark-cli"])
def test_checker_reports_a_test_helper_imported_outside_the_tests_with_file_and_line(tree, rel, text, line, words):
    (tree / "tests" / "helpers").mkdir(parents=True)
    _plant(tree, "tests/__init__.py", "")
    _plant(tree, "tests/helpers/__init__.py", "")
    _plant(tree, "tests/helpers/numerics.py", "def rel_rms(a, b):\n    return 0.0\n")
    (tree / "benchmarks").mkdir()
    assert not check(tree, TABLE, OUTSIDE)
    _plant(tree, rel, text)
    problems = check(tree, TABLE, OUTSIDE)
    assert any(p.path == rel and p.line == line and words in p.message for p in problems), problems
