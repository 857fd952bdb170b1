"""A numerics configuration with `tp=N` (and `ep=on`): the prompt through a tensor-parallel model on
N real ranks (processes, gloo), every rank tapped, the ranks' recordings joined into what one
rank would have seen, and the ranks' collectives compared.

Joining, key by key (`layout`): what each rank's output of a module should be once the split is
undone, so every module is compared with the one-rank run, the row-parallel ones included.
- `concat`: a column-parallel projection and what runs on local heads or channels (the conv, the
  forget gate, the attention core, the KDA output norm, the MLP's SwiGLU): the ranks' slices side
  by side along the first feature dimension (heads are contiguous, so rank order is the unsharded
  layout); the q|k|v conv output per third (`thirds`);
- `sum`: a partial sum the MoE's one all-reduce adds up (the routed experts, the shared expert and
  its down_proj): the sum over ranks;
- `replicated`: everything else, the all-reduced outputs included (a row-parallel o_proj or
  down_proj, the MoE, the layer): every rank should hold the one-rank output itself. The ranks'
  outputs are not required to agree: each rank has its own view (`rank_views`), the combined
  keys shared, and numerics compares every view, so a rank whose reduced output is wrong (a
  partial sum left out of the all-reduce) is named at that module, not where the next
  collective mixes its error in a layer later. `tp_disagree` lists the replicated keys whose
  ranks differ.

Collectives: each rank logs its all-reduces and all-gathers with the module it was in. Ranks that
issue different sequences (a rank skipped one, or ran another shape) are paired wrongly or hang;
the first position where the logs part names the module, on which rank."""

from __future__ import annotations

import threading

import torch

from .taps import OuroTaps, Recording

# keys (by their last name) joined side by side: column-parallel projections, then the computations
# on local heads or channels between them and the row-parallel projection
CONCAT = ("q_proj", "k_proj", "v_proj", "f_b_proj", "g_b_proj", "b_proj", "q_b_proj", "kv_b_proj", "gate_proj",
          "up_proj", "clamped_swiglu", "forget_gate", "attention_core", "o_norm", "absorb_queries")
THIRDS = ("causal_conv1d",)        # [q | k | v] channels, each third split across the ranks
TIMEOUT_S = 20.0


def _tp_rank(groups, model_dir, cfg, prompt, device, n_experts, width, load_ouro, pieces, page_size):
    """One rank: load (`load_ouro`, sharded), tap, run the prompt in the configuration's `pieces`;
    returns (its recording, its collective log, the error it stopped on or None)."""
    from ...layers.context import ForwardContext, ModelCache
    from ...parallel import tp_layers
    model = load_ouro(model_dir, cfg, device, tp_group=groups.cp, ep=cfg.ep == "on")
    log, stack = [], []
    tp_layers.COLLECTIVE_LOG = log
    hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: stack.append(n)) for n, m in model.named_modules() if n]
    hooks += [m.register_forward_hook(lambda mod, a, o: stack.pop() and None) for n, m in model.named_modules() if n]
    tp_layers.COLLECTIVE_WHERE = lambda: stack[-1] if stack else "model"
    pages = -(-len(prompt) // page_size)
    cache = ModelCache(model.config, 1, pages, page_size, dtype=getattr(torch, cfg.dtype), device=device)
    rec = Recording(n_experts=n_experts, width=width)
    box, done = {}, threading.Event()

    def work():
        try:
            with OuroTaps(model, rec, lambda: [0]), torch.inference_mode():
                start = 0
                for size in pieces(cfg, len(prompt)):
                    ctx = ForwardContext.build(cache, [size], [start], [0], torch.arange(pages).view(1, -1))
                    model(torch.tensor(prompt[start:start + size], device=device), ctx)
                    start += size
        except Exception as e:          # a collective paired with the wrong peer, or its peer gone
            box["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300] + f" (in {stack[-1] if stack else 'model'})"
        finally:
            done.set()
    # a collective whose peer never comes blocks in C++ past any timeout: the run goes on a thread
    # and this rank reports where it was when the time is up
    threading.Thread(target=work, daemon=True).start()
    if not done.wait(TIMEOUT_S):
        box["error"] = f"no progress for {TIMEOUT_S:.0f} s: blocked in a collective (in {stack[-1] if stack else 'model'})"
    for h in hooks:
        h.remove()
    tp_layers.COLLECTIVE_LOG = None
    error = box.get("error")
    return rec, log, error


def layout(key: str) -> str:
    """How the ranks' rows of `key` make the one-rank rows: concat, thirds, sum or replicated (see
    the module docstring)."""
    parts = key.split(".")
    for i in range(1, len(parts)):
        if parts[i - 1] == "mlp" and (parts[i] == "experts" or (parts[i] == "shared_experts" and
                                                                  parts[i + 1:] in ([], ["down_proj"]))):
            return "sum"            # the routed experts (and their ops), the shared expert's partial
    if parts[-1] in CONCAT:
        return "concat"
    return "thirds" if parts[-1] in THIRDS else "replicated"


def _combine(how: str, rows: list[torch.Tensor]) -> torch.Tensor:
    if how == "sum":
        return torch.stack(rows).sum(0)
    if how == "thirds":
        return torch.cat([torch.cat([r.chunk(3, 1)[i] for r in rows], 1) for i in range(3)], 1)
    return torch.cat(rows, 1)


def joined(parts: list[Recording]) -> Recording:
    """One rank's view from the ranks' recordings (see the module docstring): rank 0's, with every
    rank's in `rank_views` and the replicated keys whose ranks disagree in `tp_disagree`."""
    views = []
    for p in parts:
        v = Recording(n_experts=p.n_experts, width=p.width)
        for name in ("first_call", "kinds", "sources", "op_sources", "op_at"):
            setattr(v, name, dict(getattr(p, name)))
        v.forward_index = p.forward_index
        views.append(v)
    disagree = []
    for key, rows in parts[0].rows.items():
        per_rank = [p.rows.get(key) for p in parts]
        if any(o is None or len(o) != len(rows) for o in per_rank):
            continue
        how = layout(key)
        if how == "replicated":
            for v, own in zip(views, per_rank):
                v.rows[key] = own
            if not all(torch.equal(r, o[i][1]) for o in per_rank[1:] for i, (_, r) in enumerate(rows)):
                disagree.append(key)
        else:
            try:
                both = [(pos, _combine(how, [o[i][1] for o in per_rank])) for i, (pos, _) in enumerate(rows)]
            except RuntimeError:        # rows that do not join (another split than the table says)
                continue
            for v in views:
                v.rows[key] = both
        for v, p in zip(views, parts):
            if key in p.ops:
                v.ops.add(key)
    out = views[0]
    out.rank_views = views
    out.tp_disagree = disagree
    return out


def first_mismatch(logs: list[list], order: dict) -> dict | None:
    """The first collective where the ranks' logs part (kind, shape or module), or None. `order`: module ->
    execution rank; of the entries seen there, the earliest module is the collective the other
    ranks did not join (a rank that skips one runs its next one there instead)."""
    for i in range(max(map(len, logs), default=0)):
        entries = [tuple(log[i][:2]) + (log[i][2],) if i < len(log) else None for log in logs]
        if all(e is not None and e == entries[0] for e in entries):     # same kind, shape and module
            continue
        seen = [e for e in entries if e is not None]
        where = min(seen, key=lambda e: order.get(e[2], float("inf")))
        absent = [r for r, e in enumerate(entries) if e != where]
        return {"index": i, "module": where[2], "kind": where[0], "ranks_missing": absent,
                "seen": [None if e is None else [e[0], list(e[1]), e[2]] for e in entries]}
    return None


def run_tp(model_dir, cfg, prompt, device, n_experts, width, load_ouro, pieces, page_size) -> Recording:
    """`cfg.tp` ranks; `load_ouro`, `pieces`, `page_size`: run_configs' (passed in, as the ranks
    need them and run_configs calls this)."""
    from ...parallel.groups import launch
    got = launch(_tp_rank, cfg.tp, str(model_dir), cfg, prompt, device, n_experts, width, load_ouro, pieces, page_size,
                 timeout_s=TIMEOUT_S)
    rec = joined([g[0] for g in got])
    order = {k: i for i, k in enumerate(got[0][0].order())}
    rec.tp_mismatch = first_mismatch([g[1] for g in got], order)
    rec.tp_errors = {r: g[2] for r, g in enumerate(got) if g[2]}
    return rec
