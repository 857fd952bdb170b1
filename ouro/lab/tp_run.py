"""A numerics configuration with `tp=N` (and `ep=on`): the prompt through a tensor-parallel model on
N real ranks (processes, gloo), every rank tapped, the ranks' recordings joined into what one
rank would have seen, and the ranks' collectives compared.

Joining: a module whose output every rank holds alike (replicated, or summed by an all-reduce,
or gathered) is taken from rank 0; a column-parallel projection's output is the ranks' slices
side by side (heads are contiguous, so rank order is the unsharded layout); anything else inside
a split layer (per-head norms, partial sums, ops on local heads) has no one-rank counterpart and
is left out: its effect shows at the layer's all-reduced output.

Collectives: each rank logs its all-reduces and all-gathers with the module it was in. Ranks that
issue different sequences (a rank skipped one, or ran another shape) are paired wrongly or hang;
the first position where the logs part names the module, on which rank."""

from __future__ import annotations

import threading

import torch

from .taps import OuroTaps, Recording

COLUMN_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "f_b_proj", "g_b_proj", "b_proj", "q_b_proj", "kv_b_proj",
                      "gate_proj", "up_proj")
TIMEOUT_S = 20.0


def _tp_rank(groups, model_dir, cfg, prompt, device, n_experts, width, load_ouro, pieces, page_size):
    """One rank: load (`load_ouro`, sharded), tap, run the prompt in the configuration's `pieces`;
    returns (its recording, its collective log, the error it stopped on or None)."""
    from ..layers.context import ForwardContext, ModelCache
    from ..parallel import tp_layers
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


def joined(parts: list[Recording]) -> Recording:
    """One rank's view from the ranks' recordings (see the module docstring)."""
    first = parts[0]
    out = Recording(n_experts=first.n_experts, width=first.width)
    for name in ("first_call", "kinds", "sources", "op_sources", "op_at"):
        setattr(out, name, dict(getattr(first, name)))
    out.forward_index = first.forward_index
    for key, rows in first.rows.items():
        others = [p.rows.get(key) for p in parts[1:]]
        if any(o is None or len(o) != len(rows) for o in others):
            continue
        if all(all(torch.equal(r, o[i][1]) for i, (_, r) in enumerate(rows)) for o in others):
            out.rows[key] = rows
            if key in first.ops:
                out.ops.add(key)
        elif key.rsplit(".", 1)[-1] in COLUMN_PROJECTIONS:
            out.rows[key] = [(pos, torch.cat([r] + [o[i][1] for o in others], -1)) for i, (pos, r) in enumerate(rows)]
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
    from ..parallel.groups import launch
    got = launch(_tp_rank, cfg.tp, str(model_dir), cfg, prompt, device, n_experts, width, load_ouro, pieces, page_size,
                 timeout_s=TIMEOUT_S)
    rec = joined([g[0] for g in got])
    order = {k: i for i, k in enumerate(got[0][0].order())}
    rec.tp_mismatch = first_mismatch([g[1] for g in got], order)
    rec.tp_errors = {r: g[2] for r, g in enumerate(got) if g[2]}
    return rec
