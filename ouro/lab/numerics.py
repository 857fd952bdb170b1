"""`ouro probe numerics`: the same prompt through two configurations, every module and op tapped,
and the first module (in execution order) whose per-position error exceeds its tolerance.

    ouro probe numerics --model tiny --a dtype=float64 --b dtype=float32
    ouro probe numerics --model tiny-py --a impl=transformers --b impl=ouro
    ouro probe numerics --model tiny --a prefix=cold --b prefix=hit

`--a` is the reference. Python API: `probe_numerics(model, a, b, prompt_len, seed, device)`.
"""

from __future__ import annotations

import math

import torch

from .findings import Finding
from .run_configs import PAGE_SIZE, Config, hit_tokens, parse_config, pieces, run_config
from .taps import Recording
from .tolerances import ALLOWED_FRACTION, ERROR_FACTOR, column, tolerance

PROBE = "numerics"
DEFAULT_PROMPT_LEN = 96   # tiny: 6 KDA chunks of 16, 24 index pools (sparse past 16 tokens), 6 pages
ROW_FLOOR = 0.05          # a row's norm is floored at this share of the mean row norm


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", help="preset name or checkpoint directory")
    p.add_argument("--a", default="dtype=float64", help="reference configuration, key=value,... (default dtype=float64)")
    p.add_argument("--b", default="dtype=float32", help="configuration under test (default dtype=float32)")
    p.add_argument("--prompt-len", type=int, default=DEFAULT_PROMPT_LEN)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--kcp-sweep", default=None, metavar="CONTEXTS",
                   help="instead: the KCP state chain's precision modes (fp32, tf32, tf32x3) against float64 at "
                        "these comma-separated context lengths, on the model's KDA shapes")
    p.add_argument("--kcp-slice", type=int, default=1024, help="tokens per rank in --kcp-sweep")


def run(args) -> list[Finding]:
    if getattr(args, "kcp_sweep", None):
        from ..config import ModelConfig
        from ..models.presets import PRESETS
        from .kcp_precision import sweep, sweep_findings
        config = PRESETS[args.model] if args.model in PRESETS else ModelConfig.from_hf(args.model)
        try:
            contexts = [int(c) for c in args.kcp_sweep.split(",")]
        except ValueError:
            raise ValueError(f"--kcp-sweep takes comma-separated token counts, got {args.kcp_sweep!r}") from None
        if not contexts or min(contexts) <= args.kcp_slice:
            raise ValueError(f"--kcp-sweep contexts must be longer than --kcp-slice ({args.kcp_slice}) tokens")
        findings = sweep_findings(sweep(config, contexts, args.kcp_slice, seed=args.seed), args.kcp_slice)
        for f in findings:
            f.probe = "numerics"
        return findings
    return probe_numerics(args.model, args.a, args.b, args.prompt_len, args.seed, args.device)


def make_prompt(model_dir, n: int, seed: int) -> list[int]:
    """n tokens of real text when the checkpoint has a tokenizer (a trained model then sees its
    kind of input), else seeded random ids."""
    from ..config import ModelConfig
    from ..models.resolve import load_tokenizer
    vocab = ModelConfig.from_hf(model_dir).vocab_size
    tok = load_tokenizer(model_dir)
    if tok is not None:
        from ..models.tokenizer_corpus import CORPUS
        ids = [i for i in tok.encode(CORPUS).ids if i < vocab]
        if len(ids) >= n:
            start = (seed * 7919) % (len(ids) - n + 1)
            return ids[start:start + n]
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def probe_numerics(model: str, a: str | Config = "dtype=float64", b: str | Config = "dtype=float32",
                   prompt_len: int = DEFAULT_PROMPT_LEN, seed: int = 0, device: str = "cpu") -> list[Finding]:
    from ..models.resolve import resolve_model
    ca = a if isinstance(a, Config) else parse_config(a)
    cb = b if isinstance(b, Config) else parse_config(b)
    if prompt_len < 8:
        raise ValueError(f"--prompt-len must be at least 8, got {prompt_len}")
    if prompt_len < 2 * PAGE_SIZE + 1 and "hit" in (ca.prefix, cb.prefix):
        raise ValueError(f"prefix=hit needs a prompt of at least {2 * PAGE_SIZE + 1} tokens")
    model_dir = resolve_model(model, progress=False)
    prompt = make_prompt(model_dir, prompt_len, seed)
    # an ouro run first: its taps name every module (kind, source) that transformers is matched to
    first_b = ca.impl == "transformers" and cb.impl == "ouro"
    recs = {}
    for key, cfg in ([("b", cb), ("a", ca)] if first_b else [("a", ca), ("b", cb)]):
        names = None
        if cfg.impl == "transformers":
            names = ouro_names(next(iter(recs.values()), None), model_dir)
        recs[key] = run_config(model_dir, cfg, prompt, seed, device, names)
    ra, rb = recs["a"], recs["b"]
    broken = [f for r, cfg in ((ra, ca), (rb, cb)) for f in tp_findings(r, cfg)]
    if broken:
        return broken
    ctx = dict(model=model, a=ca, b=cb, prompt_len=prompt_len, seed=seed, device=device, n=prompt_len)
    return findings_from(ra, rb, column(ca.dtype, cb.dtype, _lossy(ca), _lossy(cb)), ctx)


def tp_findings(rec: Recording, cfg: Config) -> list[Finding]:
    """A tensor-parallel run whose ranks did not issue the same collectives (or stopped on one):
    no output of it can be trusted, so this is the finding, naming the module."""
    mismatch, errors = getattr(rec, "tp_mismatch", None), getattr(rec, "tp_errors", {})
    if not mismatch and not errors:
        return []
    if mismatch:
        src = _ouro_source(rec, mismatch["module"])
        where = {"module": mismatch["module"], "layer": _layer(mismatch["module"])}
        if src:
            where.update(file=src[0], function=src[1], line=src[2])
        return [Finding(PROBE, "error", f"{cfg}: rank(s) {mismatch['ranks_missing']} did not join the "
                        f"{mismatch['kind']} of {mismatch['module']} (collective #{mismatch['index']}); the ranks' "
                        "collectives were paired wrongly from there", where=where,
                        evidence={"collective per rank (kind, shape, module)": mismatch["seen"], "rank errors": errors},
                        next="check that every rank runs this module's collective (a rank-dependent branch skipping it)")]
    return [Finding(PROBE, "error", f"{cfg}: a rank stopped: {next(iter(errors.values()))}", evidence=errors,
                    next="run the configuration again with --b tp=1 to see whether the model itself fails")]


def _lossy(cfg: Config) -> str:
    """What a configuration quantises ("none", or its weight/KV kinds): the int8 column compares a
    quantised side with an unquantised one."""
    return "none" if cfg.quant == "none" and cfg.kv == "none" else f"{cfg.quant}/{cfg.kv}"


def ouro_names(rec: Recording | None, model_dir=None) -> dict:
    """ouro module, op and sub-computation key -> (kind, source): from an ouro run's taps, else
    (modules only) from a loaded model."""
    if rec is not None:
        return {k: (rec.kinds[k], rec.sources.get(k)) for k in rec.kinds}
    if model_dir is None:
        return {}
    from .run_configs import load_ouro
    from .taps import source_of
    from .tolerances import kind_of_module
    m = load_ouro(model_dir, Config())
    return {n: (kind_of_module(n, type(mod).__name__), source_of(mod)) for n, mod in m.named_modules() if n}


def position_errors(ref: torch.Tensor, x: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-row error of x against ref (rows flattened): relative RMS, or for token selections the
    share of the union of both selections that only one side picked. NaN -> inf."""
    ref, x = ref.reshape(ref.shape[0], -1).double(), x.reshape(x.shape[0], -1).double()
    if kind == "selection":
        union = ((ref > 0) | (x > 0)).sum(1).clamp_min(1)
        return ((ref > 0) != (x > 0)).sum(1) / union
    norms = ref.norm(dim=1)
    floor = max(float(norms.mean()) * ROW_FLOOR, 1e-30)
    err = (x - ref).norm(dim=1) / norms.clamp_min(floor)
    bad = torch.isnan(x).any(1) | torch.isnan(ref).any(1) | torch.isinf(x).any(1)
    return err.masked_fill(bad, math.inf)


def compare(ra: Recording, rb: Recording, col: str) -> list[dict]:
    """Every key both runs recorded (in a's execution order) with its per-position errors."""
    out = []
    for key in ra.order():
        sa, sb = ra.stacked(key), rb.stacked(key)
        if sa is None or sb is None:
            continue
        common = sorted(set(sa[0]) & set(sb[0]))
        if not common:
            continue
        ia = {p: i for i, p in enumerate(sa[0])}
        ib = {p: i for i, p in enumerate(sb[0])}
        ta, tb = sa[1][[ia[p] for p in common]], sb[1][[ib[p] for p in common]]
        if ta[0].numel() != tb[0].numel():   # rows may differ in layout only ([H, v] against [H * v])
            continue
        kind = ra.kinds.get(key, "other")
        err = position_errors(ta, tb, kind)
        tol = tolerance(kind, col)
        offending = err > tol
        out.append(dict(key=key, kind=kind, positions=common, err=err, tol=tol, offending=offending,
                        diverges=float(offending.float().mean()) > ALLOWED_FRACTION[col],
                        worst=float(err.max()), op=key in ra.ops or key in rb.ops))
    return out


def _ouro_source(rec, key: str):
    """The source of `key`, or of its nearest enclosing module defined in ouro (an nn.Linear's
    forward is torch's: the finding names the ouro module that owns it)."""
    while key:
        src = rec.sources.get(key)
        if src and src[0].startswith("ouro/"):
            return src
        key = key.rpartition(".")[0]
    return None


def growth(positions, err) -> dict:
    """Does the error grow with position? mean(last quarter) / mean(first quarter), correlation."""
    e = err.double().clamp(max=1e30)
    q = max(1, len(e) // 4)
    first, last = float(e[:q].mean()), float(e[-q:].mean())
    p = torch.tensor(positions, dtype=torch.float64)
    corr = float(torch.corrcoef(torch.stack([p, e]))[0, 1]) if len(e) > 2 and e.std() > 0 else 0.0
    return {"last_vs_first_quarter": last / first if first > 0 else (math.inf if last > 0 else 1.0),
            "corr_with_position": round(corr, 3) if math.isfinite(corr) else 0.0}


def _layer(key: str):
    parts = key.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit() else None


def _suspect_op(ra: Recording, key: str) -> str | None:
    """The op whose output *is* the module's output on ouro's side (e.g. the router returning
    `route(...)`): when ouro is compared with transformers, that op is where to look."""
    mod = ra.stacked(key)
    for op_key in ra.ops:
        if op_key.rsplit(".", 1)[0] != key:
            continue
        got = ra.stacked(op_key)
        if mod and got and got[0] == mod[0] and got[1].shape == mod[1].shape and torch.equal(got[1], mod[1]):
            return op_key
    return None


# what crosses a context-parallel cut into the op that computed a row there
CP_EXCHANGE = {"causal_conv1d": "the short conv's halo (ouro/parallel/cp_kda.py conv_halo)",
               "kda_chunk": "the KDA state chain (ouro/parallel/cp_kda.py kda_context_parallel)",
               "index_select": "the all-gathered indexer rows and pools (ouro/parallel/cp_context.py)",
               "sparse_mla": "the all-gathered latent rows (ouro/parallel/cp_context.py write_rows)"}


def _boundary_note(ctx, first: int, op: str | None = None) -> str | None:
    """Name the configuration seam the first offending position sits on, if it does."""
    from ..parallel.cp_context import slice_bounds
    n = ctx["n"]
    for cfg in (ctx["a"], ctx["b"]):
        if cfg.cp > 1 and first in slice_bounds(n, cfg.cp)[1:-1]:
            rank = slice_bounds(n, cfg.cp).index(first)
            crossing = CP_EXCHANGE.get(op, "what the ranks exchange (conv halo, KDA state chain, DSA rows)")
            return f"first offending position {first} is where CP rank {rank} of {cfg.cp}'s slice starts: {crossing}"
        if cfg.prefix == "hit" and first == hit_tokens(cfg, n):
            return f"first offending position {first} is the first token after the prefix-cache hit: state restored at the hit"
        starts, s = [], 0
        for size in pieces(cfg, n):
            s += size
            starts.append(s)
        if cfg.chunk and first in starts[:-1] and first % cfg.chunk == 0:
            return f"first offending position {first} starts a prefill chunk (chunk={cfg.chunk}): state carried between chunks"
        if cfg.mode == "decode" and first == n - sum(1 for p in pieces(cfg, n) if p == 1):
            return f"first offending position {first} is the first decode step: prefill->decode state hand-over"
    return None


def _views(rec: Recording) -> list[Recording]:
    """A tensor-parallel run's view of each rank (`tp_run.joined`), else the recording itself."""
    return getattr(rec, "rank_views", None) or [rec]


def findings_from(ra: Recording, rb: Recording, col: str, ctx: dict) -> list[Finding]:
    # a tensor-parallel side: every rank's view (what its reduced outputs are) against the other
    # side; the view that departs first in execution order is the finding
    tp = next((r for r in (ra, rb) if getattr(r, "rank_views", None)), None)
    best = None
    for ia, va in enumerate(_views(ra)):
        for ib, vb in enumerate(_views(rb)):
            got = compare(va, vb, col)
            first = next((i for i, r in enumerate(got) if r["diverges"]), None)
            if best is None or (first is not None and (best[0] is None or first < best[0])):
                best = (first, va, vb, got, ia if len(_views(ra)) > 1 else ib)
    first, ra, rb, rows, rank = best
    label = f"{ctx['a']} vs {ctx['b']}"
    findings = []
    if first is not None:
        if tp is not None:
            ctx = dict(ctx, tp_rank=rank, tp_disagree=getattr(tp, "tp_disagree", []))
        findings.append(_divergence(ra, rb, rows, first, col, ctx, label))
    findings.append(_logits_info(rows, label, first is None, ctx))
    return findings


def _divergence(ra, rb, rows, i, col, ctx, label) -> Finding:
    r = rows[i]
    key, err, pos = r["key"], r["err"], r["positions"]
    bad = [p for p, o in zip(pos, r["offending"].tolist()) if o]
    module = key.rsplit(".", 1)[0] if r["op"] else key
    ours = rb if rb.ops else ra          # b is the run under test (a the reference); transformers records modules only
    op_key = key if r["op"] else _suspect_op(ours, key)
    op = op_key.rsplit(".", 1)[1] if op_key else r["kind"]
    src = _ouro_source(ours, op_key or key) or _ouro_source(ours, module)
    real = ours.op_at.get(op_key, {}).get(bad[0]) if op_key else None
    if real:    # one role, several ops (the chunked kernel and the recurrent step): the one that ran there
        op, src = real, ours.op_sources.get(real, src)
    fused = ours.fused_at.get(key, {}).get(bad[0])
    if fused:   # the row came out of a fused native op (`fused_taps`): that op is where to look
        op, src = fused, ours.op_sources.get(fused, src)
    worst = r["worst"]
    bound = ERROR_FACTOR * r["tol"] if r["tol"] > 0 else 0.05
    severity = "error" if not math.isfinite(worst) or worst > bound else "warning"
    top = sorted(zip(pos, err.tolist()), key=lambda t: -t[1])[:5]
    evidence = {
        "compared": label, "precision": col, "kind": r["kind"],
        "offending_positions": f"{len(bad)} of {len(pos)}", "first_offending_position": bad[0],
        "top_positions": [[p, _num(e)] for p, e in top],
        "growth": growth(pos, err),
        "error_by_quarter": [_num(float(q.mean())) for q in err.clamp(max=1e30).chunk(4)],
        "next_modules": [{"key": x["key"], "worst": _num(x["worst"]), "tol": x["tol"]} for x in rows[i + 1:i + 4]],
    }
    if src and op_key and ours.sources.get(module):
        evidence["module_source"] = "{}:{} {}()".format(*(lambda s: (s[0], s[2], s[1]))(ours.sources[module]))
    note = _boundary_note(ctx, bad[0], op)
    if note:
        evidence["boundary"] = note
    tp_note = ""
    if ctx.get("tp_rank") is not None:
        disagree = ctx["tp_disagree"]
        evidence["tensor_parallel"] = {"rank": ctx["tp_rank"], "layout": _tp_layout(key),
                                       "reduced_outputs_the_ranks_disagree_on": disagree[:6]}
        if key in disagree:
            tp_note = (f"; rank {ctx['tp_rank']}'s output, and the ranks' outputs differ where every rank "
                       "should hold the reduced one (a partial sum left out of the all-reduce?)")
    layer = _layer(key)
    where = dict(module=module, layer=layer, op=op, positions=[bad[0], bad[-1]])
    if src:
        where.update(file=src[0], function=src[1], line=src[2])
    return Finding(PROBE, severity,
                   f"{label}: first divergence at {key} ({r['kind']}), rel RMS up to {_num(worst)} "
                   f"> {r['tol']:g} at positions {bad[0]}..{bad[-1]}{tp_note}",
                   where=where, measured=_num(worst), expected=r["tol"], evidence=evidence,
                   next=_next(ctx, layer, op, bad))


def _tp_layout(key: str) -> str:
    from .tp_run import layout
    return layout(key)


def _next(ctx, layer, op, bad) -> str:
    a, b = ctx["a"], ctx["b"]
    shorter = max(2 * PAGE_SIZE + 1 if "hit" in (a.prefix, b.prefix) else 8, min(ctx["prompt_len"], bad[0] + 8))
    base = f"ouro probe numerics --model {ctx['model']} --a '{a}' --b '{b}' --prompt-len {shorter}"
    if op in ("kda_chunk", "kda_recurrent_step", "causal_conv1d", "route", "experts_grouped", "sparse_mla",
              "index_select"):
        return f"ouro probe kernels --op {op}   (then: {base})"
    return base


def _logits_info(rows, label, clean, ctx) -> Finding:
    lg = next((r for r in rows if r["key"] == "lm_head"), None)
    margin = max(rows, key=lambda r: r["worst"] / r["tol"] if r["tol"] > 0 else (math.inf if r["worst"] > 0 else 0),
                 default=None)
    evidence = {"modules_compared": len(rows)}
    if margin is not None:
        evidence["closest_to_tolerance"] = {"key": margin["key"], "worst": _num(margin["worst"]), "tol": margin["tol"]}
    if lg is None:
        return Finding(PROBE, "info", f"{label}: logits were not compared (no common positions)", evidence=evidence)
    e = lg["err"]
    evidence.update(positions=len(lg["positions"]), mean=_num(float(e.clamp(max=1e30).mean())),
                    worst_position=lg["positions"][int(e.argmax())])
    status = "no module exceeds its tolerance" if clean else "see the divergence above"
    return Finding(PROBE, "info", f"{label}: logits agree to rel RMS {_num(lg['worst'])} (worst position); {status}",
                   where={"module": "lm_head"}, measured=_num(lg["worst"]), expected=lg["tol"], evidence=evidence)


def _num(x: float):
    return x if not math.isfinite(x) else float(f"{x:.3g}")
