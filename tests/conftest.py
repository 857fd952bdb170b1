import os

# idle OpenMP threads sleep instead of spinning: tests run servers and engine processes beside
# the test process on 2 cores, and spinning threads starve them (a 0.06 s prefill took 8 s)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# exactness checks run in float32 on every machine: `--dtype auto` would pick bf16 where it is fast
os.environ["OURO_DTYPE_AUTO"] = "float32"
# and every engine computes its projections the same way (the fast oneDNN-packed form where torch
# has oneDNN, else F.linear), so engines in a test round alike; tests/machine/test_gemm_pick.py tests every form
os.environ["OURO_GEMM_PICK"] = "packed"
# choices timed inside the suite (the W8A8 int8 forms of a test's engine, say) are timed beside the
# other workers, so a cache a user shares keeps them as provisional only (`ouro.machine.load`); tests
# of a picker's caching set OURO_BUSY_LIMIT=1 in their own cache

import pytest  # noqa: E402
import torch  # noqa: E402

from ouro.lab.reference import tie_rule  # noqa: E402

tie_rule.install()  # transformers' DSA indexer breaks score ties towards the earlier pool, as ouro does
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_sessionstart(session):
    """Every native kernel built at the start, side by side (a fresh clone's first run: ~45 s on 2
    cores, against ~90 s one family at a time as tests first reach them)."""
    from ouro.native import build, kernels
    from ouro.quant import int8_native
    build.build_side_by_side([int8_native.BUILD, *kernels.builds()])     # the longest (~35 s) first


@pytest.fixture(scope="session")
def hf_pair(tmp_path_factory):
    """shape -> (checkpoint dir, transformers model, ouro model); built once per session."""
    from transformers import Glm5NextForConditionalGeneration

    from ouro.lab.reference.checkpoint import make_hf_checkpoint
    from ouro.models.loader import load_model
    made = {}

    def get(shape):
        if shape not in made:
            d = tmp_path_factory.mktemp(f"hf_{shape}")
            make_hf_checkpoint(shape, d)
            hf = Glm5NextForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
            made[shape] = (d, hf, load_model(d))   # SimpleRunner sets the engine's products on it
        return made[shape]
    return get


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """`ouro make-model tiny` output (weights, tokenizer, template), written once per session.
    Tests must not modify it: copy it first."""
    from ouro.models.presets import make_model
    d = tmp_path_factory.mktemp("tiny_checkpoint")
    make_model("tiny", d, progress=False)
    return d
