"""A compiled decode graph called without dynamo's frame.

Each call of a `torch.compile`d function enters dynamo: its frame hook, the guard check, and the
bytecode dynamo wrote to gather the graph's inputs (for a decode step of `small`, 290 of them: every
weight, packed copy and cache tensor, reached through the model's module dicts) before the compiled
graph runs. Hot, that is ~90 us; in a decode step it is ~300-400 us (AVX2 Zen 3, batch 1), because the
step has just streamed tens of MB of weights through the caches and each of those Python objects is
a cache miss again. At batch 1 that is about a tenth of a W8A8 step.

A `DirectCall` is made for one of dynamo's cache entries (one bucket and page-table width) once the
graph is built: it runs the entry's own bytecode twice with the graph function replaced by a
recorder, at two table widths, and learns which of the graph's arguments are this step's inputs (by
identity), which are sizes of them (the symbolic width and batch), and which are the same objects
every call (weights, caches). A step then fills those slots into a prepared list and calls the graph
function itself. It is made only where the entry's code does nothing else: before the graph call it
only reads (no attribute, item or global stores), after it only picks outputs; anything else, or an
argument that fits none of the three kinds, and the step keeps dynamo's path. The model is sealed at
the first trace as it already is without guards on it (`decode_graph._sealed_guards`): weights updated
in place are seen, a parameter object replaced afterwards is not.
"""

from __future__ import annotations

import dis
import inspect
import types

import torch

# what the entry's code may do besides moving values: dynamo's size reads and profiler markers
_READ_ONLY_CALLS = frozenset({"call_size", "record_pregraph_bytecode_enter", "record_pregraph_bytecode_exit"})
_STORES = frozenset({"STORE_ATTR", "STORE_GLOBAL", "STORE_SUBSCR", "DELETE_ATTR", "DELETE_GLOBAL",
                     "DELETE_SUBSCR", "STORE_NAME", "DELETE_NAME", "IMPORT_NAME", "YIELD_VALUE"})
_MOVES = frozenset({"LOAD_FAST", "LOAD_CONST", "STORE_FAST", "DELETE_FAST", "BINARY_SUBSCR", "BUILD_LIST",
                    "BUILD_TUPLE", "LIST_EXTEND", "LIST_APPEND", "SWAP", "COPY", "POP_TOP", "RETURN_VALUE",
                    "RESUME", "NOP", "UNPACK_SEQUENCE", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR",
                    "RETURN_CONST", "CACHE", "PRECALL", "EXTENDED_ARG"})


class _Out:
    """Stands for the graph's output `i` while the entry's code runs with the recorder."""

    def __init__(self, i: int):
        self.i = i


class _Recorder:
    def __init__(self):
        self.args = None

    def __call__(self, *args):
        self.args = args
        return [_Out(i) for i in range(64)]


def _graph_function(code: types.CodeType, globals_: dict) -> str | None:
    names = [n for n in code.co_names if n.startswith("__compiled_fn") and n in globals_]
    return names[0] if len(names) == 1 else None


def _only_reads_then_moves(code: types.CodeType, graph_fn: str) -> bool:
    """Nothing is stored anywhere but the frame's locals; the last call is the graph's, every call
    before it a size read or a profiler marker (one load of those per call), and after the graph's
    call values only move."""
    ins = list(dis.get_instructions(code))
    calls = [k for k, i in enumerate(ins) if i.opname == "CALL"]
    if not calls or any(i.opname in _STORES for i in ins):
        return False
    last = calls[-1]
    helpers = graph_loads = 0
    aliases, after_helper = set(), False      # dynamo may keep a helper in a local and call it from there
    for i in ins[:last]:
        name = i.argval if i.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_GLOBAL") else None
        graph_loads += name == graph_fn
        is_helper = name in _READ_ONLY_CALLS or (i.opname == "LOAD_FAST" and i.argval in aliases)
        helpers += is_helper
        if i.opname == "STORE_FAST" and after_helper:
            aliases.add(i.argval)
        after_helper = is_helper or (after_helper and i.opname == "COPY")
    return graph_loads == 1 and helpers >= len(calls) - 1 and all(i.opname in _MOVES for i in ins[last + 1:])


def _output_map(result):
    """How the entry's result is made of the graph's outputs: an index, or a tuple/list of them."""
    if isinstance(result, _Out):
        return result.i
    if isinstance(result, (tuple, list)) and result and all(isinstance(r, _Out) for r in result):
        return type(result), tuple(r.i for r in result)
    return None


class DirectCall:
    """The graph of one dynamo cache entry, called with this step's inputs put into a prepared
    argument list (see the module's text). `make` returns None where the entry does not qualify."""

    def __init__(self, graph, constants: list, inputs_at: list[tuple[int, int]],
                 sizes_at: list[tuple[int, int, int]], output):
        self.graph, self.constants, self.inputs_at, self.sizes_at, self.output = graph, constants, inputs_at, sizes_at, output
        self.calls = 0

    @classmethod
    def make(cls, compiled, owner, inputs: tuple, wider: tuple) -> "DirectCall | None":
        """compiled: the `torch.compile`d bound method (`owner`'s `_forward` copy, signature
        (self, *inputs)); inputs: the step's inputs, which its graph has just run; wider: the same
        inputs with a different table width (the dynamic sizes tell themselves apart)."""
        try:
            from torch._dynamo.eval_frame import _debug_get_cache_entry_list
            fn = compiled._torchdynamo_orig_callable.__func__       # the bound method torch.compile wraps
            code, globals_ = fn.__code__, fn.__globals__
            names = code.co_varnames[:code.co_argcount]
            frame = dict(zip(names, (owner, *inputs)))
            if code.co_flags & inspect.CO_VARARGS:
                frame[code.co_varnames[code.co_argcount]] = tuple(inputs[code.co_argcount - 1:])
            entry = next((e for e in _debug_get_cache_entry_list(code) if e.guard_manager.check(frame)), None)
        except Exception:       # a torch without these internals: dynamo's path
            return None
        if entry is None:
            return None
        graph_fn = _graph_function(entry.code, globals_)
        if graph_fn is None or not _only_reads_then_moves(entry.code, graph_fn):
            return None
        run = types.FunctionType(entry.code, globals_)
        graph, recorder = globals_[graph_fn], _Recorder()
        globals_[graph_fn] = recorder
        try:
            with torch.inference_mode():
                out = _output_map(run(owner, *inputs))
                first = recorder.args
                run(owner, *wider)
                second = recorder.args
        except Exception:
            return None
        finally:
            globals_[graph_fn] = graph
        if out is None or first is None or second is None or len(first) != len(second):
            return None
        constants, inputs_at, sizes_at = list(first), [], []
        for i, (a, b) in enumerate(zip(first, second)):
            k = next((k for k, t in enumerate(inputs) if a is t), None)
            if k is not None:
                if second[i] is not wider[k]:
                    return None
                inputs_at.append((i, k))
            elif isinstance(a, int) and not isinstance(a, bool):
                where = next(((k, d) for k, t in enumerate(inputs) for d in range(t.dim())
                              if t.shape[d] == a and wider[k].shape[d] == b), None)
                if where is None:
                    return None
                sizes_at.append((i, *where))
            elif a is not b or isinstance(a, (int, float, bool)):
                return None     # neither an input, a size of one, nor the same object both times
        return cls(graph, constants, inputs_at, sizes_at, out)

    def __call__(self, *inputs):
        args = self.constants.copy()
        for i, k in self.inputs_at:
            args[i] = inputs[k]
        for i, k, d in self.sizes_at:
            args[i] = inputs[k].shape[d]
        self.calls += 1
        outs = self.graph(*args)
        if isinstance(self.output, int):
            return outs[self.output]
        kind, picks = self.output
        return kind(outs[i] for i in picks)
