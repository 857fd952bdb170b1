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

from ..findings import Finding
from .report import PROBE, divergence_finding, logits_finding, tp_findings
from .report import boundary_note as _boundary_note  # noqa: F401 - the tests' name for it
from .run_configs import PAGE_SIZE, Config, parse_config, run_config
from .taps import Recording
from .tolerances import ALLOWED_FRACTION, column, tolerance

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
        from ...config import ModelConfig
        from ...models.presets import PRESETS
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
            f.probe = PROBE
        return findings
    return probe_numerics(args.model, args.a, args.b, args.prompt_len, args.seed, args.device)


def make_prompt(model_dir, n: int, seed: int) -> list[int]:
    """n tokens of real text when the checkpoint has a tokenizer (a trained model then sees its
    kind of input), else seeded random ids."""
    from ...config import ModelConfig
    from ...models.resolve import load_tokenizer
    vocab = ModelConfig.from_hf(model_dir).vocab_size
    tok = load_tokenizer(model_dir)
    if tok is not None:
        from ...models.tokenizer_corpus import CORPUS
        ids = [i for i in tok.encode(CORPUS).ids if i < vocab]
        if len(ids) >= n:
            start = (seed * 7919) % (len(ids) - n + 1)
            return ids[start:start + n]
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def probe_numerics(model: str, a: str | Config = "dtype=float64", b: str | Config = "dtype=float32",
                   prompt_len: int = DEFAULT_PROMPT_LEN, seed: int = 0, device: str = "cpu") -> list[Finding]:
    from ...models.resolve import resolve_model
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
        findings.append(divergence_finding(ra, rb, rows, first, col, ctx, label))
    findings.append(logits_finding(rows, label, first is None, ctx))
    return findings


