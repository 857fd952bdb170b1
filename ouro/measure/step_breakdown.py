"""Where a decode step's time goes, part by part, against what each part must do.

`Timer` puts forward hooks around each part of a glm5_next model and charges every timed module's
time, minus its timed children's, to its row (`ROWS`); the engine's own decode steps are timed,
hooked steps interleaved with plain ones (the plain step is what the engine runs: compiled where
it compiles; hooks need the eager forward, so a hooked step runs eagerly). `part_floors` is the
roofline floor of each row: the weights its modules own (a quantised weight at its own size and
rate), its attention's own work (`step_cost`'s KDA, DSA and indexer terms), over the machine's
rates. `decode_breakdown` joins the two: what keeps a step from its floor, named by part.
`benchmarks/decode_breakdown.py` and `ouro tune`'s gap report print it.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch

from .step_cost import LOW_PRECISION, ROUTED, SCALE, StepCost, decode_cost, step_cost, weight_tensors

# "mHC (weights, merge) + layer glue": one row, since a layer's merge computes the next hyper-connection's
# weights in the same op (`hc_post_pre`), so the time of both is the layer's own.
# The model's forward outside its timed modules (the embeddings copied to n streams, the logits rows
# picked) is one row, with the streams' bytes as its floor; the engine's step outside the model
# (scheduling, the batch's metadata, the sampler, the outputs) another, with no floor: it moves no
# model data. One row held both, and the engine's ~1 ms a step read as the streams' copy 7x its floor.
MHC = "mHC (weights, merge) + layer glue"
GLUE = "model glue (streams, logits rows)"
ENGINE = "engine (scheduler, batch metadata, sampler)"
ROWS = ["routed experts", "router", "MoE combine", "shared expert + dense MLP", "KDA", "DSA without indexer",
        "DSA indexer", MHC, "norms", "embedding + head", GLUE, ENGINE]


def parts(model):
    """(module, row) pairs: every timed module and the row its *own* time (minus timed children) goes to."""
    out = [(model, GLUE), (model.embed_tokens, "embedding + head"),
           (model.lm_head, "embedding + head"), (model.norm, "norms")]
    for layer in model.layers:
        out += [(layer, MHC), (layer.attn_hc, MHC), (layer.ffn_hc, MHC), (layer.input_layernorm, "norms"),
                (layer.post_attention_layernorm, "norms")]
        a = layer.self_attn
        if layer.is_kda:
            out.append((a, "KDA"))
        else:
            out.append((a, "DSA without indexer"))
            if a.indexer is not None:
                out.append((a.indexer, "DSA indexer"))
        m = layer.mlp
        if hasattr(m, "experts"):
            out += [(m, "MoE combine"), (m.gate, "router"), (m.experts, "routed experts")]
            if m.shared_experts is not None:
                out.append((m.shared_experts, "shared expert + dense MLP"))
        else:
            out.append((m, "shared expert + dense MLP"))
    return out


class Timer:
    """Hooks that charge each timed module's time, minus its timed children's, to its row."""

    def __init__(self, model, device="cpu"):
        self.sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
        self.stack, self.seconds, self.ops, self.handles = [], defaultdict(float), defaultdict(int), []
        for module, row in parts(model):
            self.handles.append(module.register_forward_pre_hook(self._enter(row)))
            leave = lambda m, a, o: self._leave(m, a, o)   # noqa: E731 - a function can carry the mark
            leave.ouro_passive = True
            self.handles.append(module.register_forward_hook(leave))

    def _enter(self, row):
        def hook(module, args):
            self.sync()
            self.stack.append([row, time.perf_counter(), 0.0])
        # a passive hook (`ouro.layers.watch`): fused ops spanning timed modules still run, so the
        # breakdown times the step a user runs (such an op's time goes to the module that calls it)
        hook.ouro_passive = True
        return hook

    def _leave(self, module, args, out):
        self.sync()
        row, start, children = self.stack.pop()
        spent = time.perf_counter() - start
        self.seconds[row] += spent - children
        if self.stack:
            self.stack[-1][2] += spent

    def charge(self, total: float, per_row: dict) -> None:
        """A hooked run of `total` seconds: what the model's forward did not take is the engine's
        (the model's own time outside its timed modules is GLUE's); each row's seconds appended to
        per_row[row]."""
        self.seconds[ENGINE] = total - sum(s for row, s in self.seconds.items() if row != ENGINE)
        for row in ROWS:
            per_row[row].append(self.seconds.get(row, 0.0))

    def remove(self):
        for h in self.handles:
            h.remove()


def part_floors(model, context: int, batch: int, roof) -> dict:
    """{row: floor seconds} of a decode step of `batch` sequences at `context` tokens."""
    return step_part_floors(model, roof, [1] * batch, [context - 1] * batch)


def step_part_floors(model, roof, query_lens: list[int], start_pos: list[int], logits_rows: int | None = None) -> dict:
    """{row: floor seconds} of one step (`step_cost`'s arguments). A weight belongs to the innermost
    timed module holding it; routed experts count the expected distinct experts' bytes and
    `num_experts_per_tok` experts' FLOPs per token (as `step_cost` does); the head runs its
    `logits_rows` rows (one per sequence unless told), every other weight every new token."""
    c = model.config
    cost = step_cost(model, query_lens, start_pos, logits_rows)
    tokens = sum(query_lens)
    rows = len(query_lens) if logits_rows is None else logits_rows
    rows_of = {id(m): row for m, row in parts(model)}
    prefixes = sorted(((name, rows_of[id(m)]) for name, m in model.named_modules() if id(m) in rows_of),
                      key=lambda x: -len(x[0]))
    E, k = c.n_routed_experts, c.num_experts_per_tok
    distinct = cost.parts["distinct_experts_per_layer"]
    work = defaultdict(lambda: [0.0, 0.0, 0.0])        # row -> [flops, low-precision flops, bytes]
    emb = model.embed_tokens.weight
    for name, w in weight_tensors(model).items():
        row = next((r for p, r in prefixes if p and name.startswith(p + ".")), GLUE)
        nbytes = w.numel() * w.element_size()
        n = 0 if name.endswith(SCALE) else w.numel()
        if w is emb:
            nbytes, n = min(tokens, c.vocab_size) * emb.shape[1] * emb.element_size(), 0
        elif name.removesuffix(SCALE).endswith(ROUTED):
            nbytes, n = nbytes * distinct / E, n * k / E
        flops = 2.0 * (rows if name.startswith("lm_head.") else tokens) * n
        work[row][0] += flops
        work[row][1] += flops if w.dtype in LOW_PRECISION else 0.0
        work[row][2] += nbytes
    f, cb = cost.parts["flops"], cost.parts["cache_bytes"]
    work["KDA"][0] += f["kda"]
    work["KDA"][2] += cb["kda_state"]
    work["DSA without indexer"][0] += f["dsa"]
    work["DSA without indexer"][2] += cb["latent_read"] + cb["written"]
    work["DSA indexer"][0] += f["indexer"]
    work["DSA indexer"][2] += cb["pool_keys_read"] + cb["pool_inputs_read"]
    acts = cost.parts["activation_bytes"]
    for row, key in (("norms", "norms"), (MHC, "mhc"), ("MoE combine", "moe_combine"),
                     ("embedding + head", "embedding"), (GLUE, "streams")):
        work[row][2] += acts[key]
    return {row: roof.floor_s(fl, nb, low) for row, (fl, low, nb) in work.items()}


def in_decode(engine, batch: int) -> bool:
    s = engine.scheduler
    return len(s.running) == batch and not s.waiting and all(r.num_computed == r.num_tokens - 1 for r in s.running)


def reach_decode(engine, prompts: list[list[int]], params) -> None:
    """The prompts added and prefilled until every one of them decodes, then one warm-up step."""
    for p in prompts:
        engine.add_request({"prompt_token_ids": p}, params)
    while not in_decode(engine, len(prompts)):
        engine.step()
    engine.step()


def decode_breakdown(engine, prompts: list[list[int]], steps: int, roof, params) -> dict:
    """The engine's decode steps at batch len(prompts): plain steps (the engine as it runs, its
    compiled graph included) interleaved with hooked eager ones; per row the median milliseconds
    and its floor; `params`: the requests' SamplingParams (enough tokens for 2 * steps + 2)."""
    model, batch = engine.model, len(prompts)
    reach_decode(engine, prompts, params)
    runner = getattr(engine, "runner", None)
    graph = getattr(runner, "graph", None)
    plain, hooked, per_row, contexts = [], [], defaultdict(list), []
    for _ in range(steps):
        contexts.append(statistics.mean(r.num_tokens for r in engine.scheduler.running))
        t = time.perf_counter()
        engine.step()
        plain.append(time.perf_counter() - t)
        if graph is not None:
            runner.graph = None
        timer = Timer(model, engine.config.device)
        t = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t
        timer.remove()
        if graph is not None:
            runner.graph = graph
        hooked.append(total)
        timer.charge(total, per_row)
    while engine.has_unfinished():
        engine.step()
    context = round(statistics.mean(contexts))
    floors = part_floors(model, context, batch, roof)
    cost = decode_cost(model, context, batch)
    return {"batch": batch, "context": context, "compiled": graph is not None,
            **_medians(plain, hooked, per_row, floors, cost, roof)}


def _medians(plain, hooked, per_row, floors, cost, roof) -> dict:
    """The plain and hooked runs' medians, the whole floor and each row's median against its floor (ms)."""
    return {"plain_step_ms": 1e3 * statistics.median(plain), "hooked_step_ms": 1e3 * statistics.median(hooked),
            "floor_ms": 1e3 * roof.floor_s(cost.flops, cost.bytes, cost.parts["low_precision_flops"]),
            "rows": [{"part": row, "ms": 1e3 * statistics.median(per_row[row]),
                      "floor_ms": 1e3 * floors.get(row, 0.0)} for row in ROWS]}


def prefill_breakdown(engine, prompt_sets: list[list[list[int]]], roof, params) -> dict:
    """The engine's prefill of each set of prompts (one set per repeat, distinct prompts so no prefix
    is cached; `params` with max_tokens=1): the steps until every request of the set has its first
    token. Sets alternate plain (the engine as it runs) and hooked; per row the median milliseconds
    of a whole prefill and its floor: the sum of the floors of the steps the engine ran (each step
    reads the weights and runs the head on its logits rows again)."""
    model = engine.model
    plain, hooked, per_row, steps, shapes = [], [], defaultdict(list), [], []

    def record(module, args):   # each forward's (new tokens, cached tokens, logits rows) per sequence
        ctx = args[1]
        rows = sum(ctx.query_lens) if ctx.logits_index is None else int(ctx.logits_index.numel())
        shapes.append((list(ctx.query_lens), list(ctx.start_pos), rows))
    record.ouro_passive = True
    for i, prompts in enumerate(prompt_sets):
        timer = Timer(model, engine.config.device) if i % 2 else None
        recorder = model.register_forward_pre_hook(record) if i == 0 else None
        for p in prompts:
            engine.add_request({"prompt_token_ids": p}, params)
        t, n = time.perf_counter(), 0
        while engine.has_unfinished():
            engine.step()
            n += 1
        total = time.perf_counter() - t
        if recorder is not None:
            recorder.remove()
        if timer is None:
            plain.append(total)
            steps.append(n)
            continue
        timer.remove()
        hooked.append(total)
        timer.charge(total, per_row)
    lens = [len(p) for p in prompt_sets[0]]
    shapes = shapes or [(lens, [0] * len(lens), len(lens))]      # (a runner that bypasses the module)
    floors, cost = defaultdict(float), None
    for q, s, rows in shapes:
        for row, sec in step_part_floors(model, roof, q, s, rows).items():
            floors[row] += sec
        one = step_cost(model, q, s, rows)
        cost = one if cost is None else _added(cost, one)
    return {"kind": "prefill", "batch": len(lens), "tokens": sum(lens), "input_len": max(lens),
            "steps": statistics.median(steps), "compiled": False, "floor_steps": len(shapes),
            **_medians(plain, hooked, per_row, dict(floors), cost, roof)}


def _added(a, b):
    """Two steps' costs as one: their FLOPs, bytes and low-precision FLOPs added."""
    return StepCost(flops=a.flops + b.flops, weight_bytes=a.weight_bytes + b.weight_bytes,
                    cache_bytes=a.cache_bytes + b.cache_bytes, activation_bytes=a.activation_bytes + b.activation_bytes,
                    parts={"low_precision_flops": a.parts["low_precision_flops"] + b.parts["low_precision_flops"]})


def format_breakdown(b: dict, target_over_floor: float = 3.0) -> str:
    """The table, and the parts that keep the step from `target_over_floor` x its floor, largest first."""
    what = (f"prefill of {b['batch']} x {b['input_len']} tokens ({b['steps']:g} engine steps)" if b.get("kind") == "prefill"
            else f"decode step at batch {b['batch']}, context {b['context']}")
    lines = [f"{what}: {b['plain_step_ms']:.1f} ms as run"
             f"{' (compiled)' if b['compiled'] else ''} against a floor of {b['floor_ms']:.2f} ms "
             f"({b['plain_step_ms'] / b['floor_ms']:.1f}x; target {target_over_floor:g}x = "
             f"{target_over_floor * b['floor_ms']:.1f} ms). Eager, with hooks {b['hooked_step_ms']:.1f} ms, by part:",
             "| part | ms | its floor, ms | x its floor | over target x floor, ms |", "|---|---|---|---|---|"]
    for r in sorted(b["rows"], key=lambda r: -(r["ms"] - target_over_floor * r["floor_ms"])):
        x = f"{r['ms'] / r['floor_ms']:.1f}" if r["floor_ms"] > 0 else \
            "no floor (the engine's own work)" if r["part"] == ENGINE else "no floor (element-wise)"
        lines.append(f"| {r['part']} | {r['ms']:.1f} | {r['floor_ms']:.2f} | {x} | "
                     f"{max(0.0, r['ms'] - target_over_floor * r['floor_ms']):.1f} |")
    return "\n".join(lines)
