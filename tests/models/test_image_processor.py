"""ouro's glm5_next image processor against transformers' (its PIL backend), the patch layout against
the vision tower's Conv3d, placeholder expansion and image decoding."""

import io
import json
import struct
import zlib

import numpy as np
import pytest
import torch
from tests.helpers.numerics import rel_rms
from PIL import Image
from transformers.models.glm5_next.image_processing_pil_glm5_next import (
    Glm5NextImageProcessorPil,
)

from ouro.models.image_processor import ImageProcessor, expand_placeholders, load_image

BEGIN, IMG, END = 900, 901, 902


def make_image(kind: str, w: int, h: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed * 7919 + w * 31 + h)
    if kind == "noise":
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    if kind == "gradient":
        y, x = np.mgrid[0:h, 0:w]
        arr = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) * 255 // max(w + h - 2, 1)], -1)
        return Image.fromarray(arr.astype(np.uint8))
    if kind == "rgba":   # alpha everywhere from 0 to 255: composited onto white
        return Image.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8))
    if kind == "gray":
        return Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8))
    if kind == "gray_alpha":
        return Image.fromarray(rng.integers(0, 256, (h, w, 2), dtype=np.uint8))
    if kind in ("palette", "palette_transparent"):
        im = Image.frombytes("P", (w, h), rng.integers(0, 16, (h, w), dtype=np.uint8).tobytes())
        im.putpalette(rng.integers(0, 256, 16 * 3, dtype=np.uint8).tobytes())
        if kind == "palette_transparent":
            im.info["transparency"] = 3
        return im
    raise ValueError(kind)


def compare(ours: ImageProcessor, ref, images):
    got = ours(images)
    want = ref(images, return_tensors="pt")
    assert got.pixel_values.dtype == torch.float32 and got.image_grid_thw.dtype == torch.long
    assert torch.equal(got.image_grid_thw, want["image_grid_thw"]), (got.image_grid_thw, want["image_grid_thw"])
    assert got.pixel_values.shape == want["pixel_values"].shape
    assert not torch.isnan(got.pixel_values).any()
    err = rel_rms(got.pixel_values, want["pixel_values"])
    assert err <= 1e-6, f"rel RMS {err:.3e}"
    return got


@pytest.fixture(scope="module")
def ref():
    return Glm5NextImageProcessorPil()


SIZES = {  # name: (width, height)
    "tiny_10x10": (10, 10),            # below 16 tokens: scaled up
    "small_100x60": (100, 60),         # below 16 tokens: scaled up, not square
    "small_85x90": (85, 90),           # fewer pixels than 16 tokens, its aligned canvas not: still scaled up
    "typical_300x200": (300, 200),     # inside the budget: padded only
    "tall_37x1000": (37, 1000),
    "wide_1000x37": (1000, 37),
    "huge_3600x2800": (3600, 2800),    # over 8000 tokens: scaled down (bicubic)
    "thin_3x20000": (3, 20000),        # extreme aspect, inside the budget
    "wide_500000x2": (500000, 2),      # extreme aspect over the budget: collapses to one token's square
}


@pytest.mark.parametrize("name", list(SIZES))
def test_sizes_match_transformers(name, ref):
    w, h = SIZES[name]
    compare(ImageProcessor(), ref, [make_image("noise", w, h)])


KINDS = ["noise", "gradient", "rgba", "gray", "gray_alpha", "palette", "palette_transparent"]


@pytest.mark.parametrize("size", [(300, 200), (20, 15)], ids=["padded", "upscaled"])
@pytest.mark.parametrize("kind", KINDS)
def test_modes_match_transformers(kind, size, ref):
    compare(ImageProcessor(), ref, [make_image(kind, *size)])


@pytest.mark.parametrize("kind", KINDS)
def test_downscale_matches_transformers(kind):
    # a small token budget makes a small image take the bicubic path
    compare(ImageProcessor(max_image_tokens=32), Glm5NextImageProcessorPil(max_image_tokens=32),
            [make_image(kind, 333, 217)])


def test_bit_identical(ref):
    """Stricter than the 1e-6 asked for: the same roundings in the same order give the same bits."""
    for ours, theirs, img in [(ImageProcessor(), ref, make_image("noise", 300, 200)),
                              (ImageProcessor(max_image_tokens=32), Glm5NextImageProcessorPil(max_image_tokens=32),
                               make_image("rgba", 333, 217))]:
        assert torch.equal(ours(img).pixel_values, theirs(img, return_tensors="pt")["pixel_values"])


def test_batch_matches_transformers(ref):
    images = [make_image("noise", 300, 200, 1), make_image("rgba", 10, 10, 2), make_image("gray", 37, 1000, 3),
              make_image("gradient", 64, 64, 4)]
    got = compare(ImageProcessor(), ref, images)
    assert got.image_grid_thw.shape == (4, 3)


def test_token_counts_sweep(ref):
    """The resize rule alone over many sizes: grids and token counts equal the reference's."""
    ours = ImageProcessor()
    rng = np.random.default_rng(5)
    sizes = [(int(a), int(b)) for a, b in rng.integers(1, 6000, (300, 2))]
    sizes += [(1, 1), (1, 10**6), (10**6, 1), (27, 29), (28, 28), (2, 3000), (4000, 3000), (9000, 100)]
    sizes += [(h, w) for h in range(1, 120, 2) for w in range(1, 120, 3)]  # the scale-up rounding
    for h, w in sizes:
        g = ours.grid(h, w)
        assert g[1] * g[2] == ref.get_number_of_image_patches(h, w), (h, w, g)
        assert ours.tokens_per_image(torch.tensor([g])) == [g[1] * g[2] // 4]


def test_tokens_per_image():
    grid = torch.tensor([[1, 16, 22], [1, 8, 8], [1, 2, 2]])
    assert ImageProcessor().tokens_per_image(grid) == [88, 16, 1]
    assert ImageProcessor(merge_size=1).tokens_per_image(grid) == [352, 64, 4]


def test_config_from_dir(tmp_path):
    # a checkpoint's preprocessor_config.json, written by transformers itself
    src = Glm5NextImageProcessorPil(min_image_tokens=4, max_image_tokens=60, resample=2,
                                    image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.25, 0.3])
    src.save_pretrained(tmp_path)
    assert (tmp_path / "preprocessor_config.json").is_file()
    img = [make_image("noise", 500, 320), make_image("noise", 9, 7)]
    compare(ImageProcessor.from_dir(tmp_path), Glm5NextImageProcessorPil.from_pretrained(tmp_path), img)
    # a nested `image_processor` in processor_config.json wins over it, as in transformers
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {"max_image_tokens": 20}}))
    ours, theirs = ImageProcessor.from_dir(tmp_path), Glm5NextImageProcessorPil.from_pretrained(tmp_path)
    assert ours.max_image_tokens == theirs.max_image_tokens == 20
    compare(ours, theirs, img)


def test_defaults_without_config(tmp_path, ref):
    ours = ImageProcessor.from_dir(tmp_path)
    assert (ours.patch_size, ours.temporal_patch_size, ours.merge_size) == (
        ref.patch_size, ref.temporal_patch_size, ref.merge_size)
    assert (ours.min_image_tokens, ours.max_image_tokens) == (ref.min_image_tokens, ref.max_image_tokens)
    assert ours.mean.tolist() == torch.tensor(ref.image_mean, dtype=torch.float32).tolist()
    assert ours.std.tolist() == torch.tensor(ref.image_std, dtype=torch.float32).tolist()


def test_config_refusals():
    with pytest.raises(ValueError, match="do_normalize"):
        ImageProcessor.from_dict({"do_normalize": False})
    with pytest.raises(ValueError, match="patch_expand_factor"):
        ImageProcessor.from_dict({"patch_expand_factor": 2})
    # the reference refuses a budget below one token on every image; ouro when configured
    with pytest.raises(ValueError, match="too small"):
        Glm5NextImageProcessorPil(max_image_tokens=0)(make_image("noise", 50, 50))
    with pytest.raises(ValueError, match="at least one token"):
        ImageProcessor(max_image_tokens=0)


def test_layout_is_what_conv3d_reads():
    """pixel_values viewed as (channel, time, y, x) patches through the tower's Conv3d give the same
    rows as the Conv3d run over the whole (time-repeated) canvas, in merge-block order."""
    p, t, m = 14, 2, 2
    img = make_image("noise", 300, 200)
    got = ImageProcessor()(img)
    _, gh, gw = got.image_grid_thw[0].tolist()
    canvas = np.zeros((gh * p, gw * p, 3), dtype=np.uint8)     # 300x200 is padded, not scaled
    canvas[:200, :300] = np.asarray(img)
    x = (torch.from_numpy(canvas).double() / 255).float()
    x = ((x - torch.tensor([0.48145466, 0.4578275, 0.40821073])) / torch.tensor([0.26862954, 0.26130258, 0.27577711]))
    video = x.permute(2, 0, 1)[None, :, None].expand(1, 3, t, gh * p, gw * p)
    torch.manual_seed(0)
    conv = torch.nn.Conv3d(3, 8, (t, p, p), stride=(t, p, p))
    with torch.no_grad():
        whole = conv(video)[0, :, 0]                                   # [8, gh, gw]
        want = whole.reshape(8, gh // m, m, gw // m, m).permute(1, 3, 2, 4, 0).reshape(-1, 8)
        rows = conv(got.pixel_values.view(-1, 3, t, p, p)).view(-1, 8)
    assert rel_rms(rows, want) <= 1e-5


def test_swapped_layouts_are_detected(ref):
    """The comparison above is sharp: plausible wrong layouts of the same numbers fail it."""
    img = make_image("noise", 300, 200)
    want = ref(img, return_tensors="pt")["pixel_values"]
    got = ImageProcessor()(img)
    _, gh, gw = got.image_grid_thw[0].tolist()
    pv = got.pixel_values
    assert rel_rms(pv, want) <= 1e-6
    y_x_swapped = pv.view(-1, 3, 2, 14, 14).transpose(-1, -2).reshape(pv.shape)
    c_t_swapped = pv.view(-1, 3, 2, 14, 14).transpose(1, 2).reshape(pv.shape)
    raster = pv.view(gh // 2, gw // 2, 2, 2, -1).permute(0, 2, 1, 3, 4).reshape(pv.shape)  # no merge blocks
    for wrong in (y_x_swapped, raster):
        assert rel_rms(wrong, want) > 0.5
    # time is a repeat of one frame, so only (channel, time) order mixes channels
    assert rel_rms(c_t_swapped, want) > 0.1


def test_expand_one_image():
    ids = [1, 2, BEGIN, IMG, END, 3]
    assert expand_placeholders(ids, [4], IMG, BEGIN, END) == [1, 2, BEGIN, IMG, IMG, IMG, IMG, END, 3]


def test_expand_back_to_back_images():
    ids = [7, BEGIN, IMG, END, BEGIN, IMG, END, 8]
    got = expand_placeholders(ids, [2, 3], IMG, BEGIN, END)
    assert got == [7, BEGIN, IMG, IMG, END, BEGIN, IMG, IMG, IMG, END, 8]
    # and at the very start and end of the prompt, with text between the next pair
    ids = [BEGIN, IMG, END, BEGIN, IMG, END, 5, BEGIN, IMG, END]
    got = expand_placeholders(ids, [1, 2, 3], IMG, BEGIN, END)
    assert got == [BEGIN, IMG, END, BEGIN, IMG, IMG, END, 5, BEGIN, IMG, IMG, IMG, END]


def test_expand_counts_from_the_processor(ref):
    images = [make_image("noise", 300, 200), make_image("noise", 10, 10)]
    proc = ImageProcessor()
    counts = proc.tokens_per_image(proc(images).image_grid_thw)
    assert counts == [n // 4 for n in (ref.get_number_of_image_patches(200, 300), ref.get_number_of_image_patches(10, 10))]
    got = expand_placeholders([BEGIN, IMG, END, BEGIN, IMG, END], counts, IMG, BEGIN, END)
    assert got.count(IMG) == sum(counts) == 88 + 16


def test_expand_mismatch_errors():
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        expand_placeholders([BEGIN, IMG, END, BEGIN, IMG, END], [3], IMG, BEGIN, END)
    with pytest.raises(ValueError, match="1 image placeholders for 2 images"):
        expand_placeholders([1, BEGIN, IMG, END], [3, 4], IMG, BEGIN, END)
    with pytest.raises(ValueError, match="0 image placeholders for 1 images"):
        expand_placeholders([1, 2, 3], [3], IMG, BEGIN, END)
    with pytest.raises(ValueError, match="position 2"):     # already expanded: not a placeholder
        expand_placeholders([1, BEGIN, IMG, IMG, END], [2], IMG, BEGIN, END)
    with pytest.raises(ValueError, match="position 0"):     # a stray image token
        expand_placeholders([IMG, BEGIN, IMG, END], [2], IMG, BEGIN, END)
    with pytest.raises(ValueError, match="not positive"):
        expand_placeholders([BEGIN, IMG, END], [0], IMG, BEGIN, END)


def encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_load_image_formats(fmt):
    img = make_image("gradient", 64, 48)
    got = load_image(encode(img, fmt))
    assert got.size == (64, 48)
    if fmt == "PNG":  # lossless
        assert np.array_equal(np.asarray(got), np.asarray(img))


def test_load_image_keeps_transparency():
    got = load_image(encode(make_image("rgba", 20, 10), "PNG"))
    assert got.mode == "RGBA"


def test_load_image_applies_exif_orientation():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    got = load_image(encode(make_image("gradient", 64, 32), "JPEG", exif=exif))
    assert got.size == (32, 64)


def test_load_image_garbage():
    with pytest.raises(ValueError, match="cannot decode 12 bytes"):
        load_image(b"not an image")
    with pytest.raises(ValueError, match="cannot decode"):   # a format outside PNG/JPEG/WebP/GIF
        load_image(encode(make_image("noise", 8, 8), "BMP"))
    png = encode(make_image("noise", 64, 64), "PNG")
    with pytest.raises(ValueError, match="cannot decode the PNG"):  # a valid header, truncated data
        load_image(png[:200])


def png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims width x height (its pixel data could never fill that)."""
    png = bytearray(encode(make_image("noise", 4, 4), "PNG"))
    ihdr = bytes(png[12:16]) + struct.pack(">II", width, height) + bytes(png[24:29])
    png[16:24] = struct.pack(">II", width, height)
    png[29:33] = struct.pack(">I", zlib.crc32(ihdr))
    return bytes(png)


def test_load_image_too_large():
    # refused from the header: decoding this would fail with a truncation error instead
    with pytest.raises(ValueError, match="9000x9000 = 81000000 pixels, over the limit"):
        load_image(png_claiming(9000, 9000))
    with pytest.raises(ValueError, match="over the limit of 100"):
        load_image(encode(make_image("noise", 20, 10), "PNG"), max_pixels=100)
    with pytest.raises(ValueError, match="decompression bomb"):  # past PIL's own hard limit
        load_image(png_claiming(30000, 30000), max_pixels=10**10)
    assert load_image(encode(make_image("noise", 10, 10), "PNG"), max_pixels=100).size == (10, 10)
