"""Applies a planted fault to a copy of the ouro package: the named function is found by its
qualified name with `ast` (so line numbers may move as the code changes), each (old, new)
snippet is replaced inside that function only, and the result is checked: every snippet found
exactly once, the file still parses, and the function's new text contains every replacement."""

from __future__ import annotations

import ast
import importlib
import os
import shutil
import sys
import textwrap
import types
from contextlib import contextmanager
from dataclasses import dataclass, field


class FaultDoesNotApply(RuntimeError):
    """The code a fault patches has changed: the fault must be rewritten, not silently skipped."""


@dataclass
class Fault:
    name: str
    description: str
    file: str                          # repo-relative, e.g. ouro/layers/kda.py
    function: str                      # qualified: Class.method or function
    # [(old snippet, new snippet)]: the new snippet's first line takes the old one's place; its
    # other lines keep their nesting as Python reads it (see `_indent_like`)
    replace: list
    localised: list                    # alternatives: dicts of where-keys to match (see `matches`)
    probes: list                       # argument lists of `ouro probe ...` a person would run
    symptom: str = ""
    extra_imports: list = field(default_factory=list)   # lines added at the top of the file
    # environment the probes run under, clean and faulted alike: where the faulty code runs only
    # on a choice the machine times (an int8 product form), the choice pinned so it is on the path
    env: dict = field(default_factory=dict)


def find_function(tree: ast.Module, qualname: str):
    node, parts = tree, qualname.split(".")
    for part in parts:
        found = None
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and child.name == part:
                found = child
                break
        if found is None:
            return None
        node = found
    return node


def _indent_like(new: str, indent: str) -> str:
    """The first line goes where the old snippet began; the others keep their nesting relative
    to the least indented of them, which sits at the first line's level, or one level deeper
    when the first line opens a block and the next line is at that least indentation."""
    first, *rest = new.split("\n")
    if not rest:
        return first
    rest = textwrap.dedent("\n".join(rest)).split("\n")
    opens = first.split("#")[0].rstrip().endswith(":")
    if opens and rest[0] and not rest[0][0].isspace():
        indent += "    "
    return "\n".join([first] + [(indent + l) if l.strip() else l for l in rest])


def find_cpp_function(source: str, name: str) -> tuple[int, int] | None:
    """(start, end) offsets of a C++ function's definition: its signature line (`name(` at the
    start of a declaration, not a call) through the brace that closes its body."""
    import re
    for m in re.finditer(r"^[^\n;{}()]*\b" + re.escape(name) + r"\(", source, re.M):
        if m.group(0).lstrip().startswith(("return", "//")):
            continue
        depth, close = 1, m.end()
        while close < len(source) and depth:          # the parenthesis closing the parameter list
            depth += {"(": 1, ")": -1}.get(source[close], 0)
            close += 1
        brace = source.find("{", close)
        if brace < 0 or ";" in source[close:brace]:   # a declaration, not a definition
            continue
        depth, i = 0, brace
        while i < len(source):
            depth += {"{": 1, "}": -1}.get(source[i], 0)
            if depth == 0:
                return m.start(), i + 1
            i += 1
    return None


def patch_cpp(source: str, fault: Fault) -> str:
    """A planted fault in a native kernel (`ouro/native/*.cpp`, or a header they include): the same
    exactly-once rule inside the named function; the patched copy builds on its own (its build key
    is its sources' hash)."""
    span_ = find_cpp_function(source, fault.function)
    if span_ is None:
        raise FaultDoesNotApply(f"fault {fault.name}: {fault.function} is not in {fault.file} any more")
    start, end = span_
    body = source[start:end]
    for old, new in fault.replace:
        if body.count(old) != 1:
            raise FaultDoesNotApply(f"fault {fault.name}: {old!r} occurs {body.count(old)} times in {fault.function} "
                                    f"({fault.file}); it must occur exactly once")
        body = body.replace(old, new)
    return source[:start] + body + source[end:]


def patch_source(source: str, fault: Fault) -> str:
    if fault.file.endswith((".cpp", ".h")):
        return patch_cpp(source, fault)
    tree = ast.parse(source)
    fn = find_function(tree, fault.function)
    if fn is None:
        raise FaultDoesNotApply(f"fault {fault.name}: {fault.function} is not in {fault.file} any more")
    lines = source.split("\n")
    start = (fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno) - 1
    end = fn.end_lineno
    body = "\n".join(lines[start:end])
    for old, new in fault.replace:
        count = body.count(old)
        if count != 1:
            raise FaultDoesNotApply(f"fault {fault.name}: {old!r} occurs {count} times in {fault.function} "
                                    f"({fault.file}); it must occur exactly once")
        at = body.index(old)
        line_start = body.rfind("\n", 0, at) + 1
        indent = body[line_start:at] if not body[line_start:at].strip() else ""
        body = body.replace(old, _indent_like(new, indent))
    patched = "\n".join(lines[:start] + body.split("\n") + lines[end:])
    if fault.extra_imports:
        patched = "\n".join(fault.extra_imports) + "\n" + patched
    try:
        new_tree = ast.parse(patched)
    except SyntaxError as e:
        raise FaultDoesNotApply(f"fault {fault.name}: the patched {fault.file} does not parse: {e}") from None
    new_fn = find_function(new_tree, fault.function)
    new_text = "\n".join(patched.split("\n")[new_fn.lineno - 1:new_fn.end_lineno]) if new_fn is not None else None
    if new_text is None or any(n.split("\n")[0].strip() not in new_text for _, n in fault.replace):
        raise FaultDoesNotApply(f"fault {fault.name}: the replacement did not take in {fault.function}")
    return patched


SKIP_ANYWHERE = {".git", "__pycache__", ".pytest_cache", ".hypothesis", ".venv", "venv", "node_modules"}
SKIP_AT_TOP = {"runs", "build", "dist", "models"}      # training runs, build outputs, local checkpoints


def copy_tree(repo: str, dest: str) -> str:
    """The checkout without .git, virtual environments, caches and local checkpoints; the shipped
    weights are linked, not copied."""
    def ignore(d, names):
        top = os.path.abspath(d) == os.path.abspath(repo)
        return [n for n in names if n in SKIP_ANYWHERE or n.endswith(".egg-info") or (top and n in SKIP_AT_TOP)]
    shutil.copytree(repo, dest, ignore=ignore, symlinks=True,
                    copy_function=lambda s, d: os.symlink(s, d) if s.endswith(".safetensors") else shutil.copy2(s, d))
    return dest


def apply_fault(root: str, fault: Fault) -> None:
    path = os.path.join(root, fault.file)
    with open(path) as f:
        source = f.read()
    patched = patch_source(source, fault)
    with open(path, "w") as f:
        f.write(patched)


def _rebind(fn, module, owner):
    """The new function with the real module's globals, and `__class__` (zero-argument super())
    bound to the real class, not to the copy the patched source defined."""
    if not isinstance(fn, types.FunctionType):
        return fn
    if fn.__code__.co_filename != module.__file__:
        # a decorator's wrapper (`@span(...)`, `@torch.inference_mode()`) is code of another module:
        # it keeps its own globals; the patched function it wraps keeps the copy of the module's
        return fn
    cells = []
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        cells.append(types.CellType(owner) if name == "__class__" and isinstance(owner, type) else cell)
    new = types.FunctionType(fn.__code__, module.__dict__, fn.__name__, fn.__defaults__, tuple(cells) or None)
    new.__kwdefaults__, new.__qualname__, new.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    return new


@contextmanager
def applied_in_process(fault: Fault, repo: str):
    """The fault's patched function swapped into the running ouro (tests, quick checks). The
    function is compiled under its real file name, so stacks and findings name the real place;
    every loaded ouro module that imported the original object by name gets the new one too."""
    if not fault.file.endswith(".py"):
        raise FaultDoesNotApply(f"fault {fault.name} patches {fault.file}: a native kernel is loaded once per "
                                "process, so it runs in a patched copy of the package (the fault suite), not in process")
    module_name = fault.file[:-3].replace("/", ".")
    module = importlib.import_module(module_name)
    with open(os.path.join(repo, fault.file)) as f:
        patched = patch_source(f.read(), fault)
    namespace = dict(vars(module))
    exec(compile(patched, module.__file__, "exec"), namespace)
    owner_path, _, attr = fault.function.rpartition(".")
    owner = module
    for part in owner_path.split(".") if owner_path else ():
        owner = getattr(owner, part)
    new_obj = namespace
    for part in fault.function.split("."):
        new_obj = new_obj[part] if isinstance(new_obj, dict) else getattr(new_obj, part)
    original = owner.__dict__[attr]
    new_obj = _rebind(new_obj, module, owner)
    swaps = [(owner, attr, original)]
    if owner is module:   # a module-level function: rebind where it was imported by name
        for name, mod in list(sys.modules.items()):
            if name.startswith("ouro.") and mod is not None and mod is not module:
                for k, v in list(vars(mod).items()):
                    if v is original:
                        swaps.append((mod, k, v))
    try:
        for obj, k, _ in swaps:
            setattr(obj, k, new_obj)
        yield
    finally:
        for obj, k, v in swaps:
            setattr(obj, k, v)
