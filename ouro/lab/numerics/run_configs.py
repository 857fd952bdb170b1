"""A numerics configuration (`key=value,...`) and one run of it over a prompt, with taps on.

ouro runs through the real engine (`LLMEngine`: scheduler, model runner, prefix cache), so a
bug in how the serving path feeds the model shows up; transformers runs the same checkpoint as
the reference, its indexer with the earlier-pool-wins tie rule ouro documents.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch
from torch.overrides import TorchFunctionMode

from ...native.kernels import eager_only
from ...ops.kda.cp import PRECISIONS
from .hf_taps import TransformersTaps
from .taps import OuroTaps, Recording

KEYS = {
    "impl": ("ouro", "transformers"),
    "dtype": ("float32", "float64", "bfloat16"),
    "chunk": int, "mode": ("prefill", "decode"), "decode": int, "prefix": ("cold", "hit"),
    "batch": int, "kda_chunk": int,
    "cp": int, "precision": PRECISIONS,
    "split": ("off", "on"),                  # with cp=N: LayerSplit (helpers keep their own DSA layers; chunk= per CP forward)
    "quant": ("none", "w8a8", "w8a8_ref", "fp8", "fp8_ref"),   # *_ref: the naive modules (ouro.quant.reference)
    "kv": ("none", "fp8_e4m3", "int8"),      # the DSA latent / indexer-key cache rows (--kv-cache-dtype)
    # MTP speculation over the decode tokens: drafts are the forced tokens with every step's last
    # one made wrong, so each verification accepts some and rolls one back (engine.speculative)
    "spec": ("off", "nextn:K"),
    # tensor parallelism over real ranks (processes, gloo): the ranks' outputs joined (ouro.lab.numerics.tp_run)
    "tp": int, "ep": ("off", "on"),
    # the fused native ops (`ouro.native`): "watched" (the taps see every module run, so fused ops that
    # span modules fall back to eager; a module's own fused op runs), "on" (taps passive: every fused
    # op runs and a fault inside one shows at the module that ran it), "off" (the eager reference)
    "fused": ("watched", "on", "off"),
}
PAGE_SIZE = 16


@dataclass(frozen=True)
class Config:
    impl: str = "ouro"
    dtype: str = "float32"
    chunk: int | None = None      # None: the whole prompt in one step
    mode: str = "prefill"
    decode: int = 8               # decode mode: the last `decode` tokens fed one per step
    prefix: str = "cold"
    batch: int = 1
    kda_chunk: int = 16
    cp: int = 1                   # ranks of a context-parallel prefill (real processes, gloo)
    precision: str = "fp32"       # the KCP state chain's products when cp > 1
    split: str = "off"            # LayerSplit across the cp ranks
    quant: str = "none"
    kv: str = "none"
    spec: str = "off"
    tp: int = 1                   # tensor-parallel ranks
    ep: str = "off"               # with tp > 1: routed experts whole per rank
    fused: str = "watched"
    text: str = ""

    @property
    def spec_steps(self) -> int:
        return 0 if self.spec == "off" else int(self.spec.partition(":")[2])

    def __str__(self):   # a valid configuration string (the defaults when none was given)
        return self.text or "impl=ouro"


def parse_config(text: str) -> Config:
    """`dtype=float64,chunk=17` -> Config. Unknown keys or values raise ValueError naming them."""
    values = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if key not in KEYS:
            raise ValueError(f"unknown numerics configuration key {key!r} in {text!r}; known: {', '.join(KEYS)}")
        allowed = KEYS[key]
        if not eq or not value:
            raise ValueError(f"configuration key {key!r} needs a value ({key}=...)")
        if key == "spec":
            k = value.partition(":")[2]
            if value != "off" and not (value.startswith("nextn:") and k.isdigit() and int(k) >= 1):
                raise ValueError(f"configuration key 'spec' must be off or nextn:K (K >= 1 draft tokens), got {value!r}")
            values[key] = value
        elif allowed is int:
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"configuration key {key!r} needs a positive integer, got {value!r}")
            values[key] = int(value)
        elif value not in allowed:
            raise ValueError(f"configuration key {key!r} must be one of {', '.join(allowed)}, got {value!r}")
        else:
            values[key] = value
    cfg = Config(**values, text=text or "")
    if "decode" in values and cfg.mode != "decode":
        cfg = replace(cfg, mode="decode")
    if cfg.impl == "transformers":
        bad = [k for k in ("prefix", "batch", "kda_chunk", "quant", "kv", "spec") if k in values
               and values[k] != getattr(Config(), k)]
        if bad:
            raise ValueError(f"configuration key {bad[0]!r} applies to impl=ouro only (transformers runs "
                             "one sequence without ouro's prefix cache or kernels)")
    if "precision" in values and cfg.cp == 1:
        raise ValueError("configuration key 'precision' is the KCP state chain's: it needs cp=N with N >= 2")
    if "split" in values and cfg.cp == 1:
        raise ValueError("configuration key 'split' is LayerSplit across context-parallel ranks: it needs cp=N, N >= 2")
    if cfg.cp > 1:
        bad = [k for k in ("impl", "mode", "decode", "prefix", "batch", "quant", "kv", "spec") if k in values
               and values[k] != getattr(Config(), k)]
        if bad:
            raise ValueError(f"configuration key {bad[0]!r} does not combine with cp={cfg.cp}: a context-parallel "
                             "run is an ouro prefill (chunk=N tokens per CP forward), cold, of one sequence")
    if cfg.tp > 1:
        bad = [k for k in ("impl", "prefix", "batch", "spec", "cp", "kv") if k in values and values[k] != getattr(Config(), k)]
        bad += ["quant"] if cfg.ep == "on" and cfg.quant != "none" else []
        if bad:
            raise ValueError(f"configuration key {bad[0]!r} does not combine with tp={cfg.tp}: a tensor-parallel "
                             "run is one ouro sequence, cold, fed in the configuration's pieces")
    elif cfg.ep == "on":
        raise ValueError("configuration key 'ep' shards experts over the tensor-parallel ranks: it needs tp=N, N >= 2")
    return cfg


def pieces(cfg: Config, n: int) -> list[int]:
    """How the prompt's n tokens are fed: prefill chunks, then single decode tokens."""
    k = min(cfg.decode, n - 1) if cfg.mode == "decode" else 0
    pre = n - k
    size = cfg.chunk or pre
    return [min(size, pre - s) for s in range(0, pre, size)] + [1] * k


def hit_tokens(cfg: Config, n: int) -> int:
    """prefix=hit: the cached part, whole pages, about half of what is prefilled."""
    pre = n - (min(cfg.decode, n - 1) if cfg.mode == "decode" else 0)
    return max(PAGE_SIZE, (pre // 2) // PAGE_SIZE * PAGE_SIZE)


def run_config(model_dir, cfg: Config, prompt: list[int], seed: int = 0, device: str = "cpu",
               names: dict | None = None) -> Recording:
    """Run `prompt` under `cfg` with every module and op tapped; `names` (ouro name -> (kind,
    source)) is needed for transformers, to know which of its modules to record."""
    from ...config import ModelConfig
    mc = ModelConfig.from_hf(model_dir)
    rec = Recording(n_experts=mc.n_routed_experts, width=len(prompt))
    if cfg.impl == "transformers":
        _run_transformers(model_dir, cfg, prompt, rec, names or {}, device)
    elif cfg.tp > 1:
        from .tp_run import run_tp
        return run_tp(model_dir, cfg, prompt, device, rec.n_experts, rec.width, load_ouro, pieces, PAGE_SIZE)
    elif cfg.cp > 1:
        if len(prompt) < cfg.cp:
            raise ValueError(f"cp={cfg.cp} needs a prompt of at least {cfg.cp} tokens")
        from ...parallel.groups import launch
        rec.merge(launch(_cp_rank, cfg.cp, str(model_dir), cfg, prompt, device, rec.n_experts, rec.width))
    else:
        _run_ouro(model_dir, cfg, prompt, rec, seed, device)
    return rec


def load_ouro(model_dir, cfg: Config, device: str = "cpu", tp_group=None, ep: bool = False):
    """The configuration's model; with `tp_group`, this rank's shard (before any quantisation, as
    the engine does)."""
    from ...models.loader import load_model
    model = load_model(model_dir, dtype=getattr(torch, cfg.dtype), device=device, kda_chunk_size=cfg.kda_chunk)
    if tp_group is not None:
        from ...parallel.tp_shard import shard_model
        shard_model(model, tp_group, ep=ep)
    if cfg.quant != "none":
        from ...quant.w8a8 import quantize_model
        quantize_model(model, cfg.quant.removesuffix("_ref"), reference=cfg.quant.endswith("_ref"))
    return model


def _run_ouro(model_dir, cfg, prompt, rec, seed, device):
    from ...config import EngineConfig
    from ...engine.llm_engine import LLMEngine
    from ...engine.sampling import SamplingParams
    from ...layers.context import ModelCache
    model = load_ouro(model_dir, cfg, device)
    mc, n = model.config, len(prompt)
    parts = pieces(cfg, n)
    k = sum(1 for p in parts if p == 1) if cfg.mode == "decode" else 0
    pre = n - k
    tokens = n + k + 2 * PAGE_SIZE + cfg.spec_steps
    per_token = ModelCache.bytes_per_token(mc.with_mtp_layer() if cfg.spec_steps else mc, getattr(torch, cfg.dtype))
    budget = 4 * (cfg.batch + 1) * (tokens * per_token + 2 * ModelCache.bytes_per_slot(mc)) + (1 << 20)
    spec = dict(speculative_algorithm="NEXTN", speculative_num_steps=cfg.spec_steps) if cfg.spec_steps else {}
    ec = EngineConfig(device=device, page_size=PAGE_SIZE, max_num_seqs=cfg.batch + 1, max_memory=budget,
                      max_num_batched_tokens=cfg.chunk or max(4096, (cfg.batch + 1) * n), kda_chunk_size=cfg.kda_chunk,
                      kv_cache_dtype="auto" if cfg.kv == "none" else cfg.kv, enable_prefix_caching=cfg.prefix == "hit",
                      **spec)
    engine = LLMEngine(model, None, ec, verbose=False, model_dir=model_dir)
    if engine.speculator is not None:
        engine.speculator.probe_reject_last = True
    # NaN-filled: a read of never-written memory (a row, a scale, a state) shows, whatever the
    # allocator happened to hand back (a freed cache of an earlier run holds plausible values)
    engine.runner.cache.poison()
    probed = []

    def params(forced):
        return SamplingParams(max_tokens=len(forced) + 1 if forced else 1, temperature=0.0, ignore_eos=True,
                              forced_prefix_ids=forced or None)

    def add(ids, forced):
        rid = engine.add_request(list(ids), params(forced))
        return engine.requests[rid]

    def drain():
        while engine.has_unfinished():
            engine.step()

    slots = lambda: [r.slot for r in probed if r.slot is not None]
    # fused=off forces the eager reference; otherwise the caller's setting stands (a test may hold eager_only)
    with eager_only() if cfg.fused == "off" else contextlib.nullcontext(), \
            OuroTaps(model, rec, slots, passive_hooks=cfg.fused == "on"):
        if cfg.prefix == "hit":   # warm the cache with whole pages of the prompt; its rows count too
            probed.append(add(prompt[:hit_tokens(cfg, n)], []))
            drain()
        gen = torch.Generator().manual_seed(seed + 1)
        others = []
        for i in range(cfg.batch - 1):
            length = int(torch.randint(max(2, n // 2), n + 1, (1,), generator=gen))
            ids = torch.randint(1, mc.vocab_size, (length,), generator=gen).tolist()
            others.append((ids[:length - k] if k else ids, ids[length - k:] if k else []))
        half = len(others) // 2
        for ids, forced in others[:half]:
            add(ids, forced)
        probed.append(add(prompt[:pre], prompt[pre:]))
        for ids, forced in others[half:]:
            add(ids, forced)
        drain()
    return rec


def _cp_rank(groups, model_dir, cfg, prompt, device, n_experts, width) -> Recording:
    """One rank of a cp=N run: its slices of the prompt (chunk= tokens per CP forward), tapped at
    global positions; with split=on the helper ranks keep only their own DSA layers (LayerSplit)."""
    from ...layers.context import ModelCache
    from ...parallel.cp_prefill import run_prefill
    from ...parallel.layer_split import owned
    model = load_ouro(model_dir, cfg, device)
    pages = -(-len(prompt) // PAGE_SIZE)
    split, last = cfg.split == "on", groups.cp.rank() == groups.cp.size() - 1
    keep = owned(len(model.config.dsa_layers), groups.cp.size(), groups.cp.rank()) if split and not last else None
    cache = ModelCache(model.config, 1, pages, PAGE_SIZE, dtype=getattr(torch, cfg.dtype), device=device, keep_dsa=keep)
    rec = Recording(n_experts=n_experts, width=width)
    with OuroTaps(model, rec, lambda: [0]), torch.inference_mode():
        run_prefill(model, cache, groups.cp, prompt, 0, torch.arange(pages).view(1, -1), cfg.precision, cfg.chunk or 0,
                    split, full=last)
    return rec


class _StableTopk(TorchFunctionMode):
    """transformers' indexer ties broken towards the earlier pool, as ouro does."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.topk, torch.Tensor.topk):
            x, k = args[0], args[1] if len(args) > 1 else kwargs["k"]
            dim, largest = kwargs.get("dim", -1), kwargs.get("largest", True)
            v, i = torch.sort(x, dim=dim, descending=largest, stable=True)
            return torch.return_types.topk((v.narrow(dim, 0, k), i.narrow(dim, 0, k)))
        return func(*args, **kwargs)


def _run_transformers(model_dir, cfg, prompt, rec, names, device):
    try:
        from transformers import Glm5NextForConditionalGeneration
    except ImportError as e:
        raise ValueError(f"impl=transformers needs transformers with glm5_next installed ({e})") from None
    from transformers.utils import logging as hf_logging
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()     # the load report lists the unused vision tower: noise here
    hf_logging.disable_progress_bar()
    try:
        hf = Glm5NextForConditionalGeneration.from_pretrained(model_dir, dtype=getattr(torch, cfg.dtype))
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    hf = hf.to(device).eval()
    modes, handles = [], []
    for m in hf.modules():
        if type(m).__name__.endswith("Indexer"):
            handles.append(m.register_forward_pre_hook(lambda mod, a: modes.append(_StableTopk().__enter__())))
            handles.append(m.register_forward_hook(lambda mod, a, o: modes.pop().__exit__(None, None, None)))
    try:
        with TransformersTaps(hf, rec, names) as taps, torch.no_grad():
            cache, start = None, 0
            for size in pieces(cfg, len(prompt)):
                taps.positions = list(range(start, start + size))
                ids = torch.tensor([prompt[start:start + size]], device=device)
                out = hf(ids, cache=cache, use_cache=True)
                cache, start = out.cache, start + size
    finally:
        for h in handles:
            h.remove()
