"""The import-layering checker: every `ouro` import, read with `ast` (imports inside functions
included), against the allowed-imports table of `docs/structure.md`, and every import circle.

A unit is a package (`ouro/engine/`) or a top-level module (`ouro/config.py`); `ouro` itself is the
user-facing package (`ouro/__init__.py`). Inside a unit any module may import any other, as long as
no circle closes; across units only what the table allows. A row naming a folder beside `ouro/`
(`benchmarks/`) says what the scripts directly in it may import; neither they nor `ouro` may import
a test module (`tests` or any module or package under `tests/`, as a `sys.path` insert would let them).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

TABLE_HEADING = "## Allowed imports"
TESTS = "tests"


@dataclass(frozen=True)
class Problem:
    path: str          # file relative to the tree's root (the folder holding `ouro/`)
    line: int
    message: str

    def __str__(self):
        return f"{self.path}:{self.line}: {self.message}"


def read_table(structure_md: Path) -> dict[str, set[str]]:
    """{unit: units it may import} of the package's units, from the markdown table under
    TABLE_HEADING (its rows naming a folder beside `ouro/` are `read_outside`'s)."""
    return {unit: allowed for unit, allowed in _rows(structure_md).items() if not unit.endswith("/")}


def read_outside(structure_md: Path) -> dict[str, set[str]]:
    """{folder: units its scripts may import} from the table's rows naming a folder beside `ouro/`
    (`benchmarks/`)."""
    return {unit.rstrip("/"): allowed for unit, allowed in _rows(structure_md).items() if unit.endswith("/")}


def _rows(structure_md: Path) -> dict[str, set[str]]:
    text = structure_md.read_text()
    if TABLE_HEADING not in text:
        raise ValueError(f"{structure_md} has no '{TABLE_HEADING}' section")
    table: dict[str, set[str]] = {}
    for line in text.split(TABLE_HEADING, 1)[1].splitlines():
        if line.startswith("## "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue                                   # header, rule or prose
        unit = cells[0].strip("`")
        table[unit] = set(re.findall(r"`([\w.]+)`", cells[-1]))
    return table


def modules(root: Path) -> dict[str, Path]:
    """{dotted module name: file} of every module under root/ouro."""
    out = {}
    for path in sorted((root / "ouro").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "ouro"


def _imports(module: str, path: Path, known: dict[str, Path]):
    """(target module, line) for every import of an ouro module in the file."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "ouro" or alias.name.startswith("ouro."):
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not (base == "ouro" or base.startswith("ouro.")):
                continue
            for alias in node.names:            # `from ..measure import spans` imports the module ouro.measure.spans
                sub = f"{base}.{alias.name}"
                yield (sub if sub in known else base), node.lineno


def names_under_tests(root: Path) -> set[str]:
    """The names a test module goes by: `tests`, and every module and package under root/tests
    (each one importable by its own name once tests/ or a folder in it is on sys.path)."""
    names = set()
    for path in (root / TESTS).rglob("*.py"):
        parts = path.relative_to(root / TESTS).with_suffix("").parts
        if "__pycache__" not in parts:
            names.update(p for p in parts if p != "__init__")
            names.add(TESTS)
    return names


def _test_imports(path: Path, names: set[str]):
    """(imported name, line) for every absolute import of a test module in the file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in names:
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] in names:
            yield node.module, node.lineno


def edges(root: Path) -> list[tuple[str, str, Path, int]]:
    known = modules(root)
    return [(m, target, path, line) for m, path in known.items() for target, line in _imports(m, path, known)]


def circles(all_edges) -> list[list[str]]:
    """Strongly connected groups of more than one module (and modules importing themselves)."""
    graph: dict[str, set[str]] = {}
    for src, dst, _, _ in all_edges:
        graph.setdefault(src, set()).add(dst)
        graph.setdefault(dst, set())
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in graph:                          # iterative Tarjan: no recursion limit on a deep tree
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    group.append(m)
                    if m == node:
                        break
                if len(group) > 1 or node in graph[node]:
                    found.append(sorted(group))
    return found


def table_circles(table: dict[str, set[str]]) -> list[list[str]]:
    return circles([(a, b, None, 0) for a, allowed in table.items() for b in allowed])


def check(root: Path, table: dict[str, set[str]], outside: dict[str, set[str]] | None = None) -> list[Problem]:
    """Every import the table does not allow, every unit it does not name, every import circle,
    every import of a test module; with `outside` (`read_outside`), the same for the scripts of
    those folders."""
    problems = []
    known, tests = modules(root), names_under_tests(root)
    for m, path in known.items():
        for name, line in _test_imports(path, tests):
            problems.append(Problem(str(path.relative_to(root)), line,
                                    f"`{unit_of(m)}` imports the test module `{name}`: only tests import tests/"))
    for folder, allowed in (outside or {}).items():
        for path in sorted((root / folder).glob("*.py")):
            rel = str(path.relative_to(root))
            for dst, line in _imports(f"{folder}.{path.stem}", path, known):
                b = unit_of(dst)
                if b not in allowed:
                    problems.append(Problem(rel, line, f"`{folder}` may not import `{b}` ({rel} imports {dst}): "
                                                       f"`{folder}` may import {', '.join(sorted(allowed))}"))
            for name, line in _test_imports(path, tests):
                problems.append(Problem(rel, line,
                                        f"`{folder}` imports the test module `{name}`: only tests import tests/"))
    all_edges = edges(root)
    for src, dst, path, line in all_edges:
        rel = str(path.relative_to(root))
        a, b = unit_of(src), unit_of(dst)
        if a not in table:
            problems.append(Problem(rel, 1, f"unit `{a}` is not in the allowed-imports table of docs/structure.md"))
        elif a != b and b not in table[a]:
            problems.append(Problem(rel, line, f"`{a}` may not import `{b}` ({src} imports {dst}): "
                                               f"`{a}` may import {', '.join(sorted(table[a])) or 'nothing of ouro'}"))
    where = {(s, d): (p, n) for s, d, p, n in all_edges}
    for group in circles(all_edges):
        members = set(group)
        src, dst = next((s, d) for s, d, _, _ in all_edges if s in members and d in members)
        path, line = where[(src, dst)]
        problems.append(Problem(str(path.relative_to(root)), line,
                                f"import circle of {len(group)} modules: {', '.join(group)} (one link: {src} imports {dst})"))
    return sorted(set(problems), key=lambda p: (p.path, p.line, p.message))
