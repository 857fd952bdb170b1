"""`ouro probe vision`: images through ouro and transformers, compared where they can go wrong.

    ouro probe vision --model tiny-vl --images 60x90,90x40

1. The vision tower: every module of ouro's tower and of transformers' `model.visual` (the same
   names) tapped on the same pixels, and the steps inside a module that transformers computes
   inline (`sub_taps.VISION_POINTS`: a block's attention core, each SwiGLU), read on both sides
   as the input of the module that consumes them; the first module or step, in ouro's execution
   order, that turns a matching input into an output past the float32 tolerance is the finding,
   with its class's file and function (a step's input is its owner module's). Where ouro's module
   takes its input in another layout than transformers' (`REFERENCE_INPUT_LAYOUT`: ouro's 2x2
   merge groups the patches itself), the reference's input is read back in ouro's layout.
2. The image rows where the text model takes them: a prompt with the images through ouro's engine
   (processor, tower, placeholder expansion, the rows scattered into the prefill chunks) against
   transformers' `inputs_embeds` after its `masked_scatter`; rows past tolerance are a finding
   naming their positions, whether they are image positions, and whether they match the
   reference one position over (a scatter off by one).
"""

from __future__ import annotations

import inspect

import torch

from ..findings import Finding
from ..kernels.refs import rel_rms
from .sub_taps import vision_points

PROBE = "vision"
TOL = 1e-4          # float32 relative RMS of a module's output (the tower agrees to ~1e-6)


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny-vl", help="a checkpoint with a vision tower (preset or directory)")
    p.add_argument("--images", default="60x90,90x40", help="WxH of each image in the prompt (random pixels)")
    p.add_argument("--seed", type=int, default=0)


def run(args) -> list[Finding]:
    try:
        sizes = [tuple(int(v) for v in s.lower().split("x")) for s in args.images.split(",")]
    except ValueError:
        raise ValueError(f"--images takes WxH sizes separated by commas, got {args.images!r}") from None
    return probe_vision(args.model, sizes, args.seed)


def pictures(sizes, seed: int) -> list:
    from PIL import Image
    g = torch.Generator().manual_seed(seed)
    return [Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())
            for w, h in sizes]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The lab's relative RMS error (inf on a shape mismatch or a non-finite value), `a` seen in `b`'s shape."""
    return rel_rms(a.reshape(b.shape), b)


# transformers' input of a module -> the layout ouro's module of the same name takes: its
# `downsample` conv gets the 2x2 blocks [N / 4, hidden, 2, 2]; ouro's groups the patches [N, hidden]
REFERENCE_INPUT_LAYOUT = {"downsample": lambda t: t.permute(0, 2, 3, 1).reshape(-1, t.shape[1])}


def record(tower, layouts: dict | None = None) -> tuple[dict, dict, list, list, dict]:
    """Hooks on every named submodule and on the named steps (`vision_points`): ({name: output},
    {name: first input, in `layouts`' form where it names one}, names in the order their calls end,
    handles, {step: owner module name})."""
    out, inp, order, handles = {}, {}, [], []
    modules = {n: m for n, m in tower.named_modules() if n}
    steps = {}
    for target, owner, key in vision_points(modules):
        steps[key] = owner

        def step(mod, args, key=key, owner=owner):
            if key not in out and args and isinstance(args[0], torch.Tensor):
                out[key] = args[0].detach().float().clone()
                if owner in inp:
                    inp[key] = inp[owner]         # the step's input is its owner's
                order.append(key)
        handles.append(modules[target].register_forward_pre_hook(step))
    for name, m in modules.items():
        def pre(mod, args, name=name):
            if name not in inp and args and isinstance(args[0], torch.Tensor):
                t = args[0].detach().float()
                inp[name] = (layouts[name](t) if name in (layouts or {}) else t).clone()

        def hook(mod, args, o, name=name):
            t = o[0] if isinstance(o, tuple) else o
            if isinstance(t, torch.Tensor) and name not in out:
                out[name] = t.detach().float().clone()
                order.append(name)
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(hook))
    return out, inp, order, handles, steps


def source_of(module) -> dict:
    cls = type(module)
    try:
        file = inspect.getsourcefile(cls)
    except TypeError:
        return {}
    rel_file = file[file.rfind("ouro/"):] if "ouro/" in file else file
    return {"file": rel_file, "function": f"{cls.__name__}.forward"}


def load_reference(model_dir):
    from transformers import Glm5NextForConditionalGeneration
    from transformers.utils import logging as hf_logging
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return Glm5NextForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    finally:
        hf_logging.set_verbosity(verbosity)


@torch.no_grad()
def tower_findings(tower, hf_visual, pixels, grid) -> list[Finding]:
    ours, ours_in, order, h1, steps = record(tower)
    theirs, theirs_in, _, h2, _ = record(hf_visual, REFERENCE_INPUT_LAYOUT)
    try:
        tower(pixels, grid)
        hf_visual(pixels, grid_thw=grid)
    finally:
        for h in h1 + h2:
            h.remove()
    errors = [(n, rel(ours[n], theirs[n])) for n in order if n in theirs and ours[n].numel() == theirs[n].numel()]

    def input_ok(n):            # a module whose input already differs inherited its error
        a, b = ours_in.get(n), theirs_in.get(n)
        return a is None or b is None or a.numel() != b.numel() or rel(a, b) <= TOL
    modules = dict(tower.named_modules())
    for i, (name, err) in enumerate(errors):
        if err > TOL and input_ok(name):       # (inf: a NaN or a shape that does not fit)
            owner = modules[steps.get(name, name)]
            cls = type(owner).__name__
            what = f"step `{name.rsplit('.', 1)[1]}` of {cls}" if name in steps else cls
            where = {"module": f"visual.{name}", **source_of(owner)}
            if name in steps:
                where["op"] = name.rsplit(".", 1)[1]
            return [Finding(PROBE, "error", f"vision tower: `visual.{name}` ({what}) is the first module or step to "
                            f"turn a matching input into an output past tolerance: rel RMS {err:.2e} against transformers",
                            where=where, measured=err, expected=TOL,
                            evidence={"before it (in execution order)": [f"{n}: {e:.1e}" for n, e in errors[max(0, i - 4):i]]},
                            next=f"read {cls}.forward against transformers' module of the same name")]
    worst = max((e for _, e in errors), default=0.0)
    return [Finding(PROBE, "info", f"vision tower: {len(errors)} modules agree with transformers (worst rel RMS "
                    f"{worst:.1e})", measured=worst, expected=TOL)]


@torch.no_grad()
def row_findings(model_dir, hf, images, config) -> list[Finding]:
    from ...config import EngineConfig
    from ...engine.llm_engine import LLMEngine
    from ...engine.multimodal import image_positions
    from ...engine.sampling import SamplingParams
    from ...models.loader import load_model
    model = load_model(model_dir)
    placeholder = [config.image_start_token_id, config.image_token_id, config.image_end_token_id]
    ids = [5, 6, 7] + placeholder * len(images) + [8, 9]
    rows = []
    h = model.layers[0].register_forward_pre_hook(lambda m, a: rows.append(a[0][:, 0].detach().clone()))
    eng = LLMEngine(model, None, EngineConfig(max_memory=64 << 20, page_size=16, max_num_batched_tokens=16),
                    verbose=False, model_dir=model_dir)
    try:
        eng.add_request({"prompt_token_ids": ids, "multi_modal_data": {"image": images}},
                        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        prompt = None
        while eng.has_unfinished():
            for o in eng.step():
                prompt = o.prompt_token_ids
    finally:
        h.remove()
    ours = torch.cat(rows)[:len(prompt)]
    seen = {}

    def keep(m, a, kw):
        seen.setdefault("x", kw["inputs_embeds"][0].detach().clone())
    h = hf.model.language_model.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        pixels, grid = eng.image_encoder().processor(images)
        hf(input_ids=torch.tensor([prompt]), pixel_values=pixels, image_grid_thw=grid)
    finally:
        h.remove()
    ref = seen["x"]
    err = torch.tensor([rel(a, b) for a, b in zip(ours, ref)])
    bad = (err > TOL).nonzero().flatten().tolist()
    where_images = set(image_positions(prompt, config))
    if not bad:
        return [Finding(PROBE, "info", f"image rows: the {len(prompt)} input rows of the prompt agree with "
                        f"transformers' (worst rel RMS {float(err.max()):.1e})", measured=float(err.max()), expected=TOL)]
    shifted = {d: sum(rel(ours[p], ref[p - d]) < TOL for p in bad if 0 <= p - d < len(ref)) for d in (1, -1)}
    d = max(shifted, key=shifted.get)
    how = f"; {shifted[d]} of them equal the reference row {d:+d} position(s) over" if shifted[d] else ""
    return [Finding(PROBE, "error", f"image rows: {len(bad)} of the prompt's input rows differ from transformers' "
                    f"(positions {bad[0]}..{bad[-1]}, {sum(p in where_images for p in bad)} of them image "
                    f"positions){how}",
                    where={"module": "image rows (ForwardContext.embeds)", "positions": [bad[0], bad[-1]],
                           "file": "ouro/engine/model_runner.py", "function": "image_rows"},
                    measured=float(err.max()), expected=TOL,
                    evidence={"image positions": [min(where_images), max(where_images)] if where_images else None,
                              "first bad rows": [f"{p}: {float(err[p]):.2e}" for p in bad[:6]]},
                    next="check which prompt positions each chunk's image rows are written to (image_rows, "
                         "ImageInputs.chunk_rows)")]


def probe_vision(model: str, sizes, seed: int = 0) -> list[Finding]:
    from ...config import ModelConfig
    from ...models.image_processor import ImageProcessor
    from ...models.loader import load_vision
    from ...models.resolve import resolve_model
    d = resolve_model(model, progress=False)
    tower = load_vision(d)
    if tower is None:
        raise ValueError(f"{model} has no vision tower: probe a checkpoint with model.visual.* tensors (e.g. tiny-vl)")
    hf = load_reference(d)
    images = pictures(sizes, seed)
    pixels, grid = ImageProcessor.from_dir(d)(images)
    return tower_findings(tower.eval(), hf.model.visual, pixels, grid) + \
        row_findings(d, hf, images, ModelConfig.from_hf(d))
