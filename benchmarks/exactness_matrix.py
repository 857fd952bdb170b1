"""Print the worst relative RMS error of ouro's logits against transformers for the test matrix
(the cases of tests/models/test_model_vs_transformers.py, then the config options and KDA chunk sizes
of tests/models/test_options_vs_transformers.py), on checkpoints transformers saves
(ouro/lab/reference/checkpoint.py: every constant-initialised tensor randomised, indexer ties broken
towards the earlier pool).

    python benchmarks/exactness_matrix.py
"""

import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from transformers import Glm5NextForConditionalGeneration  # noqa: E402
from transformers.utils import logging  # noqa: E402

from ouro.engine.simple_runner import SimpleRunner  # noqa: E402
from ouro.lab.reference.checkpoint import make_hf_checkpoint  # noqa: E402
from ouro.lab.reference.compare import compare, reference_run, rel_rms, selection_diff  # noqa: E402
from ouro.lab.reference.options import OPTIONS  # noqa: E402
from ouro.models.loader import load_model  # noqa: E402

logging.set_verbosity_error()


def cases(hf, model):
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    full = lambda ids: hf(torch.tensor([ids])).logits[0]
    for n in (1, 7, 64, 300):
        ids = torch.randint(0, V, (n,), generator=g).tolist()
        yield f"prefill {n}", rel_rms(SimpleRunner(model, 1, 512).step([ids], logits="all"), full(ids))
    differ = sum(len(rows) for rows in selection_diff(hf, model, ids).values())
    print(f"  (prefill {n}: {differ} query rows select other tokens than transformers)")
    ids = torch.randint(0, V, (200,), generator=g).tolist()
    r = SimpleRunner(model, 1, 512)
    yield "chunks of 17", rel_rms(torch.cat([r.step([ids[s:s + 17]], logits="all") for s in range(0, 200, 17)]),
                                  full(ids))
    out = hf(torch.tensor([ids]), use_cache=True)
    cache, r, worst = out.cache, SimpleRunner(model, 1, 256), 0.0
    worst = rel_rms(r.step([ids])[0], out.logits[0, -1])
    for _ in range(40):
        tok = int(out.logits[0, -1].argmax())
        out = hf(torch.tensor([[tok]]), cache=cache, use_cache=True)
        cache = out.cache
        worst = max(worst, rel_rms(r.step([[tok]])[0], out.logits[0, -1]))
    yield "40 decode steps", worst
    seqs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (37, 120, 5)]
    out, off, worst = SimpleRunner(model, 3, 256).step(seqs, logits="all"), 0, 0.0
    for s in seqs:
        worst = max(worst, rel_rms(out[off:off + len(s)], full(s)))
        off += len(s)
    yield "flat batch of 3", worst


def load(d, **kw):
    return Glm5NextForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval(), load_model(d, **kw)


def main():
    with torch.no_grad():
        for shape in ("tiny", "shared"):
            with tempfile.TemporaryDirectory() as d:
                make_hf_checkpoint(shape, d)
                hf, model = load(d)
                for name, err in cases(hf, model):
                    print(f"{shape:7s} {name:24s} rel RMS {err:.2e}")
                if shape == "tiny":
                    ref = reference_run(hf, torch.randint(0, model.config.vocab_size, (250,)).tolist(), 4)
                    for chunk in (1, 5, 8, 12, 32, 64):
                        result = compare(load_model(d, kda_chunk_size=chunk), ref)
                        print(f"{shape:7s} {f'kda_chunk_size={chunk}':24s} {result}")
        for name, options in OPTIONS.items():
            with tempfile.TemporaryDirectory() as d:
                make_hf_checkpoint("tiny", d, **options)
                hf, model = load(d)
                ref = reference_run(hf, torch.randint(0, model.config.vocab_size, (250,)).tolist(), 4)
                print(f"tiny    {name:24s} {compare(model, ref)}")


if __name__ == "__main__":
    main()
