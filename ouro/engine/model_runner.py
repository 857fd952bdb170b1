"""Turn a scheduled batch into one model call, in three steps with one contract each:

- `prepare(batch) -> StepInputs`: the rows in slot order and which way the step runs (a
  context-parallel prefill, the compiled decode step, or the eager forward of the flat batch:
  cu_seqlens, positions, page tables, state slots, the rows whose logits are wanted);
- `forward(inputs)`: the model call, told first to the other ranks (`ranks`, a rank group);
- `collect(inputs, output) -> logits [B, V]`: each row's last logits (float32, on the CPU), the
  prompt logprobs of the rows that ask, the speculative records, and each row's computed count.

`execute(batch)` is the three in order. KDA checkpoints are the engine's (`checkpointer.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..measure.spans import span
from ..layers.context import ForwardContext, ModelCache
from .memory import MemoryPlan
from .ranks import LocalRanks
from .request import RequestFailed
from .sampling import prompt_logprob_entries
from .scheduler import ScheduledBatch


def candidates_needed(params) -> int:
    """How many of the best tokens a request's next pick reads (greedy: 1; top-k sampling: k, as
    top-p and min-p then act within them); 0 when it reads more (all-token logprobs, a forced
    prefix, sampling without top-k)."""
    if params.logprobs or params.prompt_logprobs is not None or params.forced_prefix_ids:
        return 0
    return 1 if params.temperature == 0 else max(params.top_k, 0)


def image_rows(reqs, counts, device):
    """(flat rows, their embeddings) of the batch's image positions, or None: a chunk covering a
    prompt's image tokens takes the image rows instead of the tokens' embeddings."""
    rows, values, start = [], [], 0
    for r, n in zip(reqs, counts):
        if r.mm is not None and r.num_computed < len(r.prompt_ids):
            offsets, which = r.mm.chunk_rows(r.num_computed, n)
            rows += [start + o for o in offsets]
            if which:
                values.append(r.mm.embeds[which[0]: which[-1] + 1])
        start += n
    if not rows:
        return None
    return torch.tensor(rows, device=device), torch.cat(values).to(device)


@dataclass
class StepInputs:
    """One model call prepared from a scheduled batch: what `forward` runs and what `collect`
    needs to turn its output into each row's logits."""
    reqs: list
    counts: list[int]
    path: str                     # "cp" (a context-parallel prefill), "graph" (the compiled decode step), "eager"
    ids: list[int]                # the flat batch's token ids (eager), one per row (graph), the prompt (cp)
    ctx: ForwardContext | None = None        # eager only
    candidates: int = 0           # the head's best-k mode under tensor parallelism; 0: full logits
    records: dict = field(default_factory=dict)    # row -> speculative replay record (draft-carrying rows)
    prompt_rows: list | None = None          # per row: chunk positions whose logits give prompt logprobs
    first: list | None = None     # per row: its first and last row of the logits; None: one row each
    last: list | None = None


class ModelRunner:
    def __init__(self, model, plan: MemoryPlan, device="cpu", compile_max_bs: int = 0, cp=None, kv_kinds=None,
                 cache_config=None, keep_hidden: bool = False):
        """compile_max_bs > 0: decode batches up to that size run as a compiled graph
        (`ouro.engine.decode_graph`); it takes one more state slot and page, for padding rows.
        cache_config: the config the cache is laid out for (the model's, or with the MTP draft layer)."""
        from ..machine.model_forms import apply_to
        from ..native.kernels import load_all
        self.model = model
        self.device = device
        if torch.device(device).type == "cpu":
            load_all()           # a first start builds the fused kernels side by side, not one per first use
        apply_to(model)          # each projection's product, by measurement on this machine
        dtype = model.embed_tokens.weight.dtype
        extra = 1 if compile_max_bs else 0     # the scratch slot and page sit past the pools' ids
        self.speculator = None   # an `engine.speculative.Speculator` when drafting
        self.step_extra = None   # (logits of every row of the draft-carrying requests, hidden, cu_seqlens)
        self.cache = ModelCache(cache_config or model.config, plan.n_slots + extra, plan.n_pages + extra, plan.page_size,
                                dtype=dtype, device=device, kv_kinds=kv_kinds)
        self.cp = cp             # a `CPPrefill` (ouro.parallel.cp_prefill) for batch.context_parallel
        self.ranks = LocalRanks()    # the engine's rank group under tensor parallelism (`TPWorkers`)
        # set by the engine: the model's lm_head is vocabulary-parallel and nothing reads the logits
        # beyond the sampler (no logits processors, no recorded logits)
        self.candidates_allowed = False
        self.graph = None
        if compile_max_bs:
            from .decode_graph import DecodeGraph
            self.graph = DecodeGraph(model, self.cache, plan.n_slots, plan.n_pages, compile_max_bs, keep_hidden=keep_hidden)

    def warm_up(self, progress: bool = True) -> dict:
        """Compile the decode step for every bucket now (every rank alike), not in the first requests."""
        self.ranks.warm_up()
        return self.graph.warm_up(progress)

    @span("execute", cat="compute")
    @torch.inference_mode()  # no autograd bookkeeping at all: cheaper per op than no_grad
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Compute the batch's new tokens; returns float32 logits [B, V] of each last new token.
        Rows asking for prompt logprobs also get the logits of their chunk's prompt positions,
        reduced at once to their `prompt_logprobs` entries; other rows compute only the last."""
        inputs = self.prepare(batch)
        with span("forward", cat="compute"):
            output = self.forward(inputs)
        return self.collect(inputs, output)

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """The batch's rows in slot order (the batch is reordered too: the caller samples in this
        order) and everything the model call takes. Of the requests it changes only a draft-carrying
        row's `spec_record` (the replay record its forward fills)."""
        # batch rows in slot order: with dense slots, KDA layers then update states in place
        order = sorted(range(len(batch.requests)), key=lambda i: batch.requests[i].slot)
        batch.requests = [batch.requests[i] for i in order]
        batch.num_new_tokens = [batch.num_new_tokens[i] for i in order]
        reqs, counts = batch.requests, batch.num_new_tokens
        if batch.context_parallel:
            return StepInputs(reqs, counts, "cp", reqs[0].all_ids[:counts[0]])
        if self.graph is not None and self.graph.accepts(counts, any(r.prompt_logprobs is not None for r in reqs)):
            # the graph gathers the full logits (one traced form for every batch): candidates 0
            return StepInputs(reqs, counts, "graph", [r.all_ids[r.num_computed] for r in reqs])
        width = max(len(r.pages) for r in reqs)
        table = torch.tensor([r.pages + [0] * (width - len(r.pages)) for r in reqs], dtype=torch.long)
        records = self.speculator.records_for(reqs, counts) if self.speculator is not None else {}
        # a row carrying drafts wants the logits of all its positions (prompt logprobs never: it is past its prompt)
        prompt_rows = [list(range(n - 1)) if b in records else self._prompt_rows(r, n)
                       for b, (r, n) in enumerate(zip(reqs, counts))]
        index = first = last = None
        if any(prompt_rows):
            # logits of every wanted prompt position of the rows that ask, and each row's last
            index, first, last, start = [], [], [], 0
            for wanted, n in zip(prompt_rows, counts):
                first.append(len(index))
                index += [start + p for p in wanted]
                if not wanted or wanted[-1] != n - 1:
                    index.append(start + n - 1)
                last.append(len(index) - 1)
                start += n
        ctx = ForwardContext.build(self.cache, counts, [r.num_computed for r in reqs], [r.slot for r in reqs], table,
                                   logits="last" if index is None else index)
        candidates = 0
        if self.candidates_allowed:   # tensor parallel: only each rank's k best tokens cross, where that is exact
            need = [candidates_needed(r.params) for r in reqs]
            candidates = max(need) if index is None and not records and all(need) else 0
        ctx.keep_hidden, ctx.replay = self.speculator is not None, records or None
        ids = [t for r, n in zip(reqs, counts)
               for t in (r.all_ids + r.draft_ids if n > r.num_tokens - r.num_computed else r.all_ids)
               [r.num_computed: r.num_computed + n]]
        ctx.embeds = image_rows(reqs, counts, self.device)
        return StepInputs(reqs, counts, "eager", ids, ctx, candidates, records, prompt_rows, first, last)

    def forward(self, inputs: StepInputs):
        """The model call `inputs` describes, on every rank: its raw output."""
        reqs = inputs.reqs
        if inputs.path == "cp":       # every rank is sent its slice by the CP prefill itself
            r = reqs[0]
            try:
                return self.cp.prefill(self.cache, inputs.ids, r.slot, r.pages)
            except RuntimeError as e:       # a CPPrefillError: this request only
                raise RequestFailed(r.request_id, str(e)) from e
        if self.candidates_allowed:
            self.model.lm_head.candidates = inputs.candidates
        if inputs.path == "graph":
            args = (inputs.ids, [r.num_computed for r in reqs], [r.slot for r in reqs], [r.pages for r in reqs])
            self.ranks.graph_step(*args)
            return self.graph.run(*args)
        ids = torch.tensor(inputs.ids, device=self.device)
        self.ranks.forward(ids, inputs.ctx, inputs.candidates)
        return self.model(ids, inputs.ctx)

    def collect(self, inputs: StepInputs, output) -> torch.Tensor:
        """Float32 logits [B, V] on the CPU (sampling runs there, with per-request CPU generators)
        of each row's last new token; prompt logprobs filled, speculative records kept in
        `step_extra`, each row's computed count moved on (a draft-carrying row's is the engine's)."""
        reqs, counts = inputs.reqs, inputs.counts
        if inputs.path == "cp":
            reqs[0].num_computed += counts[0]
            return output.float().cpu()
        if inputs.path == "graph":
            logits = output
            if self.graph.keep_hidden:       # drafting reads every row's final hidden state
                logits, hidden = output
                self.step_extra = ({}, hidden, torch.arange(len(reqs) + 1))
            for r in reqs:
                r.num_computed += 1
            return logits.float().cpu()
        logits, records, ctx, first = output, inputs.records, inputs.ctx, inputs.first
        if records:
            self.step_extra = ({b: logits[first[b]: inputs.last[b] + 1].float().cpu() for b in records},
                               ctx.hidden, ctx.cu_seqlens)
        elif self.speculator is not None:
            self.step_extra = ({}, ctx.hidden, ctx.cu_seqlens)
        if first is not None:
            self._fill_prompt_logprobs(reqs, [[] if b in records else w for b, w in enumerate(inputs.prompt_rows)],
                                       first, logits)
            logits = logits[torch.tensor(inputs.last, device=logits.device)]
        for b, (r, n) in enumerate(zip(reqs, counts)):
            if b not in records:          # a draft-carrying row commits what the engine accepts
                r.num_computed += n
        return logits.float().cpu()

    @staticmethod
    def _prompt_rows(r, n: int) -> list[int]:
        """Chunk-relative rows whose logits give a prompt-logprobs entry not yet filled: position
        p predicts prompt token p + 1 (a recomputed request does not redo filled entries)."""
        if r.prompt_logprobs is None:
            return []
        start, end = r.num_computed, min(r.num_computed + n, len(r.prompt_ids) - 1)
        return [p - start for p in range(start, end) if r.prompt_logprobs[p + 1] is None]

    @staticmethod
    def _fill_prompt_logprobs(reqs, prompt_rows, first, logits) -> None:
        for r, wanted, i in zip(reqs, prompt_rows, first):
            if wanted:
                pos, ranks = [r.num_computed + p for p in wanted], []
                entries = prompt_logprob_entries(logits[i:i + len(wanted)], [r.prompt_ids[p + 1] for p in pos],
                                                 r.params.prompt_logprobs, ranks=ranks)
                for p, e, rank in zip(pos, entries, ranks):
                    r.prompt_logprobs[p + 1] = e
                    if r.prompt_ranks is not None:
                        r.prompt_ranks[p + 1] = rank
