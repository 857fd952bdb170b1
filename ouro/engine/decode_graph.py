"""`--compile`: the decode step as a compiled graph, at padded batch-size buckets.

A decode batch (one new token per sequence) is padded to the next bucket (powers of two from 2 up
to `max_bs`) and its page table to the next power of two in width, then runs one traced forward
over a `GraphContext`: tensors only, no host reads, no data-dependent Python (see
`ouro.layers.context.GraphContext` for how each host-side decision is made on tensors). Padding
rows read and write only a scratch state slot and a scratch page, which the runner allocates
beside the cache and no sequence owns, so padding never changes a real row's output.

torch.compile traces it once with dynamic sizes (a few graphs in all: size thresholds inside the
ops, such as the indexer's "fewer pools than it keeps", become guards), inductor builds it on a
CPU, and on CUDA `mode="reduce-overhead"` records a CUDA graph per bucket: the same structure. The
projections and routed experts call the products the machine picked directly (their `graph_forward`).
The graph keeps dynamo's guards on its inputs, sizes and module globals but none on the model
(`_sealed_guards`): the model is sealed at the first trace, its weights read in place each call, and
a step with a forward hook added since runs eagerly. Everything is compiled at start-up, bucket by
bucket with a progress bar; inductor keeps its kernels in its on-disk cache, so a later start is
faster. Batches that are not pure decode (a
prefill chunk, prompt logprobs) or larger than `max_bs` run eagerly."""

from __future__ import annotations

import itertools
import time
import types

import torch
from torch.nn.modules import module as module_hooks
from torch.utils.hooks import RemovableHandle

from ..layers.context import GraphContext, ModelCache
from ..layers.merged import bound_merged
from ..native.kernels import load_all, switches
from ..ops.opaque import opaque_key
from .graph_direct import DirectCall


BACKEND = "inductor"    # torch.compile's backend (tests use aot_eager: the same capture, no C++ build)
_INSTANCES = itertools.count()


def counting_backend(name: str = "aot_eager"):
    """A torch.compile backend that runs `name` and keeps every graph it is handed in `.graphs`
    (the tests and `ouro probe redundancy --graph` count them)."""
    from torch._dynamo.backends.registry import lookup_backend
    inner = lookup_backend(name)

    def compile_fn(gm, example_inputs):
        compile_fn.graphs.append(gm)
        return inner(gm, example_inputs)
    compile_fn.graphs = []
    return compile_fn


def buckets(max_bs: int) -> list[int]:
    """Batch sizes a graph runs at: 1, 2, 4, 8, ... up to max_bs (included). torch specialises size
    1, so batch 1 is a graph of its own: padded to 2 it would route a padding row through the
    experts too, up to twice the expert weights read at the batch where bytes are the whole cost."""
    out, b = [1], 2
    while b < max_bs:
        out.append(b)
        b *= 2
    return out + [max_bs] if max_bs > 1 else out


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _sealed_guards(entries) -> list[bool]:
    """Which of dynamo's guards a decode graph keeps: those on its inputs (sizes, dtypes, strides), the
    symbolic size relations that pick a graph, global state (grad mode, default device) and module
    globals (which fused op a layer calls); not those on the model and cache (`self...`: thousands of
    module attribute, hook and parameter checks, most of a batch-1 step's host time). The model is
    sealed at its first trace: while a hook added later is there, the step runs eagerly (`sealed`)."""
    return [not (e.name.startswith("self") or e.name.startswith("dict(type(self")) for e in entries]


class DecodeGraph:
    def __init__(self, model, cache: ModelCache, scratch_slot: int, scratch_page: int, max_bs: int,
                 backend=None, mode: str | None = None, keep_hidden: bool = False):
        """keep_hidden: the step also returns every row's final hidden state (speculative drafting)."""
        self.model, self.cache, self.keep_hidden = model, cache, keep_hidden
        self.scratch_slot, self.scratch_page = scratch_slot, scratch_page
        self.buckets = buckets(max_bs)
        self.max_bs = self.buckets[-1]
        c = model.config
        # the indexer scores pools: a table at least this wide has more pools than it keeps, so
        # every width takes the same branch (the selection is the same either way)
        self.min_width = _next_pow2(c.index_topk // cache.page_size + 1) if c.indexer_layers else 1
        load_all()     # the fused kernels built before the trace reads whether they are there
        for m in model.modules():
            if hasattr(m, "eager_shape"):
                opaque_key(m)
        if mode is None and str(next(model.parameters()).device).startswith("cuda"):
            mode = "reduce-overhead"
        # fullgraph: a host sync or data-dependent Python in the decode path fails the trace
        # dynamo keeps its graphs and its recompile budget per code object: a copy of `_forward`'s
        # code for each instance keeps one model's (or cache's) graphs from counting against another's;
        # its own name too: dynamo keys what it learnt about sizes (automatic dynamic shapes) by file,
        # line and name, and an inductor graph built on what another instance's trace learnt gave
        # wrong tokens (a W8A8 model compiled after another model, one process)
        fwd = DecodeGraph._forward
        own = types.FunctionType(fwd.__code__.replace(co_name=f"_forward_{next(_INSTANCES)}"), fwd.__globals__,
                                 fwd.__name__)
        backend = backend or BACKEND
        options = {"guard_filter_fn": _sealed_guards}
        if backend == "inductor":
            # inductor's wrapper checks every input's size and stride per call (hundreds at decode,
            # most of a batch-1 step's host time left); the inputs are this class's own, made one way
            options["size_asserts"] = False
            if mode == "reduce-overhead":        # the mode's one option: torch takes a mode or options
                options["triton.cudagraphs"], mode = True, None
            else:
                # the graph's ~200 calls of native ops and kernels a step made from C++, not Python: a
                # W8A8 batch-1 step of `small` 6.29 -> 5.16 ms (two engines stepped in turn, one process,
                # AVX2 Zen 3); the first build takes longer (43 against 18 s), inductor caches it on disk
                options["cpp_wrapper"] = True
        self._compiled = torch.compile(types.MethodType(own, self), backend=backend, mode=mode,
                                       fullgraph=True, options=options)
        # (bucket, table width, fused switches) -> the graph called without dynamo's frame (`graph_direct`), None where
        # that entry does not qualify; CPU only (a host-time saving, the CUDA path is left as torch runs it)
        self._direct: dict[tuple, DirectCall | None] = {}
        self.direct = str(next(model.parameters()).device) == "cpu"
        self._modules = list(model.modules())
        self._sealed_hooks: tuple | None = None     # the model's forward hooks at the first trace
        self._handles_seen = 0                      # torch's hook-handle count at the last look
        self._hooked = False
        self.runs = 0
        self._bound = False

    def _step(self, *inputs):
        if not self._bound:
            # the step once eagerly first: it makes the merged projections and the int8 kernel's packed
            # weights that the trace then calls directly (`merged.graph_merged`, `quant.packed.graph_pack`)
            # (an all-padding batch of one: it touches only the scratch state; the model's own forward,
            # not its call: a hook on the model mirrors eager forwards to TP followers, which make
            # their own graph the same way)
            ids, *rest = self.inputs([0], [0], [self.scratch_slot], [[self.scratch_page]])
            self.model.forward(ids, self._context(*rest))
            for m in bound_merged(self.model):     # a merged projection may run as an opaque op too
                opaque_key(m)
            self._bound = True
            self._sealed_hooks, self._handles_seen = self._hooks(), RemovableHandle.next_id
        # dynamo's guards see a changed fused-path switch and trace again; the direct call is keyed by it
        key = (inputs[0].shape[0], inputs[-1].shape[1], switches())
        direct = self._direct.get(key) if self.direct else None
        if direct is not None:
            return direct(*inputs)
        # only the batch and the page-table width vary: every other size and constant is traced as it
        # is (batch 1 is its own graph: torch specialises size 1)
        if inputs[0].shape[0] > 1:
            for t in inputs:
                torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(inputs[-1], 1)
        out = self._compiled(*inputs)
        if self.direct and key not in self._direct:
            table = inputs[-1]
            wider = (*inputs[:-1], torch.cat([table, torch.full_like(table, self.scratch_page)], dim=1))
            self._direct[key] = DirectCall.make(self._compiled, self, inputs, wider)
        return out

    def _context(self, positions, slot_mapping, state_slots, fresh, page_table) -> GraphContext:
        ctx = GraphContext(self.cache, positions, slot_mapping, state_slots, fresh, page_table, self.scratch_page)
        ctx.keep_hidden = self.keep_hidden
        return ctx

    def _forward(self, ids, *rest):
        ctx = self._context(*rest)
        logits = self.model(ids, ctx)
        return (logits, ctx.hidden) if self.keep_hidden else logits

    def accepts(self, counts, prompt_logprobs: bool) -> bool:
        return (not prompt_logprobs and len(counts) <= self.max_bs and all(n == 1 for n in counts)
                and self.sealed())

    def _hooks(self) -> tuple:
        """Every forward hook the model's modules run (their handles' numbers), global ones included."""
        return (*module_hooks._global_forward_pre_hooks, *module_hooks._global_forward_hooks,
                *(k for m in self._modules for d in (m._forward_pre_hooks, m._forward_hooks) for k in d))

    def sealed(self) -> bool:
        """Whether the model has the forward hooks it had at the first trace, no more, no fewer. The
        graph keeps no guard on the model (`_sealed_guards`), so a hook added later would not run in
        it: the step runs eagerly while one is there (the lab's timers and probes). O(1) while no hook
        was registered anywhere since the last look (torch numbers every hook handle); a walk over the
        model's hooks otherwise."""
        if self._sealed_hooks is None:
            return True
        if RemovableHandle.next_id != self._handles_seen or self._hooked:
            self._hooked = self._hooks() != self._sealed_hooks
            self._handles_seen = RemovableHandle.next_id
        return not self._hooked

    def inputs(self, ids, start_pos, slots, pages):
        """The padded step inputs for a decode batch (host lists; `pages` one page list per row)."""
        B = len(ids)
        bucket = next(b for b in self.buckets if b >= B)
        ps = self.cache.page_size
        width = max(self.min_width, _next_pow2(max(len(p) for p in pages)))
        pad = bucket - B
        table = [p + [self.scratch_page] * (width - len(p)) for p in pages] + [[self.scratch_page] * width] * pad
        positions = list(start_pos) + [0] * pad
        slot_mapping = [p[pos // ps] * ps + pos % ps for p, pos in zip(pages, start_pos)] + [self.scratch_page * ps] * pad
        dev = self.cache.device
        as_t = lambda v, dt=torch.long: torch.tensor(v, dtype=dt, device=dev)
        return (as_t(list(ids) + [0] * pad), as_t(positions), as_t(slot_mapping),
                as_t(list(slots) + [self.scratch_slot] * pad), as_t([s == 0 for s in start_pos] + [True] * pad, torch.bool),
                as_t(table))

    def run(self, ids, start_pos, slots, pages) -> torch.Tensor:
        """Logits [B, V] of a decode batch: token ids, their positions (tokens already cached),
        state slots and page lists, one per sequence (with keep_hidden: and the hidden states [B, D])."""
        self.runs += 1
        out = self._step(*self.inputs(ids, start_pos, slots, pages))
        if self.keep_hidden:
            return out[0][:len(ids)], out[1][:len(ids)]
        return out[:len(ids)]

    def warm_up(self, progress: bool = True) -> dict:
        """Compile for every bucket now (all-padding batches: they touch only scratch state)."""
        from tqdm import tqdm
        start = time.perf_counter()
        with torch.inference_mode():
            for b in tqdm(self.buckets, desc="compiling the decode step", disable=not progress):
                self._step(*self.inputs([0] * b, [0] * b, [self.scratch_slot] * b, [[self.scratch_page]] * b))
        return {"buckets": list(self.buckets), "seconds": time.perf_counter() - start}
