"""`ouro plan --tp/--cp/--device-memory`: the per-device figures follow from real allocations (the
model's parameters, a ModelCache sized for the context), scale as parallelism says, and bad input
is refused with the option named."""

import pytest
import torch

from ouro.engine.device_plan import device_plan, parse_bytes
from ouro.layers.context import ModelCache
from ouro.models.glm5_next import Glm5NextModel
from ouro.models.presets import PRESETS


def test_weights_are_the_models_tensors_and_tp_splits_only_the_split_parts():
    c = PRESETS["tiny"]
    model = Glm5NextModel(c).to(torch.bfloat16)               # float32-kept parts stay float32, as loaded
    real = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert device_plan(c, 1024).weight_bytes == real
    half = device_plan(c, 1024, tp=2).weight_bytes            # tests/parallel/test_tp.py: equal to a real rank's
    assert real // 2 < half < 0.7 * real                      # the replicated parts (mHC, norms, indexer, router) stay


@pytest.mark.parametrize("context", [1, 64, 1000])
def test_request_bytes_are_what_a_cache_of_that_context_allocates(context):
    c = PRESETS["tiny"]
    pages = -(-context // 64)
    cache = ModelCache(c, n_slots=1, n_pages=pages, page_size=64, dtype=torch.bfloat16)
    paged = sum(t.nbytes for t in (cache.latent, cache.index_keys, cache.index_gates, cache.index_pooled))
    state = cache.conv.nbytes + cache.recurrent.nbytes
    p = device_plan(c, context, kv_dtype=torch.bfloat16)
    assert p.latent_bytes == paged and p.kda_state_bytes == state
    assert device_plan(c, context, tp=2).kda_state_bytes == state // 2      # KDA heads split
    assert device_plan(c, context, tp=2).latent_bytes == paged               # the MLA latent is not


def test_fits_and_scaling():
    c = PRESETS["flash"]
    p = device_plan(c, 1 << 20, tp=8, cp=4, device_bytes=parse_bytes("141GB"))
    assert p.fits == (p.device_bytes - p.weight_bytes - p.activation_bytes) // p.request_bytes
    assert device_plan(c, 1 << 20, tp=8, cp=4, device_bytes=parse_bytes("200GB")).fits > p.fits
    assert device_plan(c, 1 << 19, tp=8, cp=4, device_bytes=parse_bytes("141GB")).fits > p.fits
    assert device_plan(c, 1 << 20, tp=8).fits is None
    longer = device_plan(c, 1 << 21, tp=8)
    assert longer.latent_bytes == 2 * device_plan(c, 1 << 20, tp=8).latent_bytes
    # 11 of 45 layers keep a latent, and the indexer adds a little: the hybrid saves KV memory
    assert 2.0 < p.kv_saving < 45 / 11
    assert device_plan(c, 1 << 20, tp=8, cp=8).chunk_tokens <= device_plan(c, 1 << 20, tp=8, cp=1).chunk_tokens


def test_bad_input_is_refused_with_the_option_named():
    with pytest.raises(ValueError, match="--tp 3 does not divide"):
        device_plan(PRESETS["flash"], 1024, tp=3)
    with pytest.raises(ValueError, match="cp must be an integer >= 1"):
        device_plan(PRESETS["flash"], 1024, cp=0)
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes("lots")
    assert parse_bytes("141GB") == 141 * 10**9 and parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("1e9") == 10**9


@pytest.mark.parametrize("preset", ["tiny", "small", "tiny-py"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_config_cache_sizes_are_what_a_model_cache_allocates(preset, dtype):
    """`ModelConfig.cache_bytes_per_token` / `state_bytes_per_slot` (what measure/step_cost and the
    planners count without importing the layers) against a real ModelCache's tensors."""
    c = PRESETS[preset]
    pages, page_size, slots = 3, 64, 2
    cache = ModelCache(c, n_slots=slots, n_pages=pages, page_size=page_size, dtype=dtype)
    paged = sum(t.nbytes for t in (cache.latent, cache.index_keys, cache.index_gates, cache.index_pooled))
    assert paged == pages * page_size * c.cache_bytes_per_token(dtype)
    assert cache.conv.nbytes + cache.recurrent.nbytes == slots * c.state_bytes_per_slot


@pytest.mark.processes
def test_vision_plan_counts_the_tower_and_an_images_tokens():
    """The tower's parameters as the built tower has them (and transformers' tower of the published
    dimensions), an image's tokens as the processor gives them, and the section in `ouro plan`."""
    import subprocess
    import sys

    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextVisionConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

    from ouro.config.model import VisionConfig
    from ouro.engine.vision_plan import image_cost, tower_parameters
    from ouro.models.image_processor import ImageProcessor
    from ouro.models.presets import VISION_PRESETS
    from ouro.models.vision import VisionModel
    tiny = VISION_PRESETS["tiny-vl"]
    assert tower_parameters(tiny) == sum(p.numel() for p in VisionModel(tiny).parameters())
    with torch.device("meta"):
        hf = Glm5NextVisionModel(Glm5NextVisionConfig())
    assert tower_parameters(VisionConfig()) == sum(p.numel() for p in hf.parameters())
    proc = ImageProcessor()
    for h, w in ((448, 448), (768, 1024), (10, 10), (2800, 3600)):
        c = image_cost(VisionConfig(), h, w)
        assert c["tokens"] == proc.tokens_per_image(torch.tensor([proc.grid(h, w)]))[0] and c["activation_bytes"] > 0
    assert image_cost(VisionConfig(), 2800, 3600)["tokens"] <= 8000
    out = subprocess.run([sys.executable, "-m", "ouro.cli", "plan", "--model", "tiny-vl", "--context", "64",
                          "--image-size", "448x448"], capture_output=True, text=True, check=True).stdout
    assert "vision tower" in out and f"-> {image_cost(tiny, 448, 448)['tokens']:,} tokens" in out
