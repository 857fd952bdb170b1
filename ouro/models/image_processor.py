"""glm5_next's image processor: PIL images to the vision tower's patches, and the prompt's image
placeholders expanded to each image's token count.

Matches transformers' `Glm5NextImageProcessorPil` value for value. One image token covers a
28x28 (patch*merge) square. An image keeps its aspect ratio: its canvas is its size rounded up to
multiples of 28, grown or shrunk to within 16..8000 tokens (`canvas_size` has the one exception);
the image is scaled (PIL bicubic) only if it holds fewer pixels than 16 tokens (up) or its canvas
had to shrink (down), then zero-padded on the bottom and right to fill the canvas.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
DECODE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MAX_DECODE_PIXELS = 8192 * 8192  # a decompression bomb is refused before its pixels are decoded


class ProcessedImages(NamedTuple):
    pixel_values: torch.Tensor    # float32 [total patches, 3 * temporal * patch * patch]
    image_grid_thw: torch.Tensor  # int64 [images, 3]: (1, patch rows, patch columns)


class ImageProcessor:
    def __init__(self, patch_size: int = 14, temporal_patch_size: int = 2, merge_size: int = 2,
                 min_image_tokens: int = 16, max_image_tokens: int = 8000,
                 image_mean=CLIP_MEAN, image_std=CLIP_STD, rescale_factor: float = 1 / 255,
                 resample: int = Image.Resampling.BICUBIC):
        if min(patch_size, temporal_patch_size, merge_size) < 1:
            raise ValueError(f"patch sizes must be positive: patch {patch_size}, temporal "
                             f"{temporal_patch_size}, merge {merge_size}")
        if max_image_tokens < 1:  # transformers raises this on every image; say it once, here
            raise ValueError(f"max_image_tokens={max_image_tokens}: an image needs at least one token")
        self.patch_size, self.temporal_patch_size, self.merge_size = patch_size, temporal_patch_size, merge_size
        self.min_image_tokens, self.max_image_tokens = min_image_tokens, max_image_tokens
        self.mean = torch.tensor(image_mean, dtype=torch.float32)
        self.std = torch.tensor(image_std, dtype=torch.float32)
        self.rescale_factor, self.resample = rescale_factor, Image.Resampling(resample)
        self.factor = patch_size * merge_size          # the side of one token's square, in pixels
        self.pixels_per_token = temporal_patch_size * self.factor ** 2

    @classmethod
    def from_dict(cls, cfg: dict) -> ImageProcessor:
        """From a `preprocessor_config.json` dict; steps the reference can switch off must be on."""
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if cfg.get(flag, True) is not True:
                raise ValueError(f"image processor config sets {flag}={cfg[flag]!r}: only the default is supported")
        if cfg.get("patch_expand_factor", 1) != 1:
            # transformers' two backends disagree here (only the torchvision one scales the canvas by it)
            raise ValueError(f"patch_expand_factor={cfg['patch_expand_factor']} is not supported")
        keys = ("patch_size", "temporal_patch_size", "merge_size", "min_image_tokens", "max_image_tokens",
                "image_mean", "image_std", "rescale_factor", "resample")
        return cls(**{k: cfg[k] for k in keys if k in cfg})

    @classmethod
    def from_dir(cls, model_dir) -> ImageProcessor:
        """As transformers reads a checkpoint: `processor_config.json`'s nested `image_processor`
        first, then `preprocessor_config.json`, else the glm5_next defaults."""
        d = Path(model_dir)
        if (d / "processor_config.json").is_file():
            nested = json.loads((d / "processor_config.json").read_text()).get("image_processor")
            if nested is not None:
                return cls.from_dict(nested)
        if (d / "preprocessor_config.json").is_file():
            return cls.from_dict(json.loads((d / "preprocessor_config.json").read_text()))
        return cls()

    def canvas_size(self, height: int, width: int) -> tuple[int, int]:
        """The padded (height, width), multiples of `factor`, inside the token budget."""
        f, frames = self.factor, self.temporal_patch_size
        min_px = self.min_image_tokens * self.pixels_per_token
        max_px = self.max_image_tokens * self.pixels_per_token
        h, w = _align(height, f), _align(width, f)
        if frames * h * w < min_px:  # too small: scale both sides up by the missing area ratio
            scale = math.sqrt(min_px / (frames * height * width))
            h, w = _align(max(1, math.ceil(height * scale)), f), _align(max(1, math.ceil(width * scale)), f)
        if frames * h * w <= max_px:
            return h, w
        # too large: the tallest content height whose aligned canvas fits (the aligned area grows
        # with the content height, so bisect); if none fits, one token's square. A very wide,
        # short image cannot shrink its width below width/height, so it lands there too.
        best, lo, hi = (f, f), 1, height
        while lo <= hi:
            mid = (lo + hi) // 2
            ch, cw = _align(mid, f), _align(max(1, math.floor(width * mid / height)), f)
            if frames * ch * cw <= max_px:
                best, lo = (ch, cw), mid + 1
            else:
                hi = mid - 1
        return best

    def content_size(self, height: int, width: int, canvas: tuple[int, int]) -> tuple[int, int]:
        """The size the image is scaled to before padding: never up when the image already holds
        `min_image_tokens` of pixels, never past the canvas, never to zero."""
        ch, cw = canvas
        scale = min(ch / height, cw / width)
        if self.temporal_patch_size * height * width >= self.pixels_per_token * self.min_image_tokens:
            scale = min(1.0, scale)
        return max(1, min(ch, math.floor(height * scale))), max(1, min(cw, math.floor(width * scale)))

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """(1, patch rows, patch columns) for an image of this size, without its pixels."""
        ch, cw = self.canvas_size(height, width)
        return 1, ch // self.patch_size, cw // self.patch_size

    def tokens_per_image(self, grid_thw: torch.Tensor) -> list[int]:
        """Image tokens per image: its patches, merge x merge of them to a token."""
        grid_thw = torch.as_tensor(grid_thw).reshape(-1, 3)
        return [int(n) // self.merge_size ** 2 for n in grid_thw.prod(dim=1).tolist()]

    def _patches(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        rgb = to_rgb(image)
        width, height = rgb.size
        canvas = self.canvas_size(height, width)
        content = self.content_size(height, width, canvas)
        if content != (height, width):
            rgb = rgb.resize((content[1], content[0]), resample=self.resample)
        # pad with black *before* normalising, as the reference does: the pad is (0 - mean) / std
        pixels = torch.zeros(canvas[0], canvas[1], 3, dtype=torch.uint8)
        pixels[:content[0], :content[1]] = torch.from_numpy(np.array(rgb, dtype=np.uint8))
        # rescale in float64 then round to float32, normalise in float32: the reference's roundings
        x = (pixels.to(torch.float64) * self.rescale_factor).to(torch.float32)
        x = (x - self.mean) / self.std
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = canvas[0] // p, canvas[1] // p
        # rows ordered by merge block (row-major), then patch inside the block (row-major), so each
        # token's m*m patches are adjacent; a row is (channel, time, y, x), what the Conv3d reads.
        # A still image is its own second frame: time repeats the same pixels.
        x = x.reshape(gh // m, m, p, gw // m, m, p, 3)
        x = x.permute(0, 3, 1, 4, 6, 2, 5)  # (block y, block x, in-block y, in-block x, c, py, px)
        x = x.unsqueeze(5).expand(-1, -1, -1, -1, -1, t, -1, -1)
        return x.reshape(gh * gw, 3 * t * p * p), (1, gh, gw)

    def __call__(self, images) -> ProcessedImages:
        """One PIL image or a list of them: patches of every image, in order, and their grids."""
        images = [images] if isinstance(images, Image.Image) else list(images)
        if not images:
            raise ValueError("no images to process")
        for i, im in enumerate(images):
            if not isinstance(im, Image.Image):
                raise TypeError(f"image {i}: expected a PIL image, got {type(im).__name__}")
        done = [self._patches(im) for im in images]
        return ProcessedImages(torch.cat([d[0] for d in done]),
                               torch.tensor([d[1] for d in done], dtype=torch.long))


def _align(value: int, factor: int) -> int:
    return math.ceil(value / factor) * factor


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as the reference converts: anything transparent (an alpha band, or a palette or
    grayscale image with a transparent colour) is composited onto white first."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def load_image(data: bytes, max_pixels: int = MAX_DECODE_PIXELS) -> Image.Image:
    """Decode PNG / JPEG / WebP / GIF bytes (a GIF's first frame), upright per its EXIF
    orientation as transformers' `load_image` turns it; the mode is kept (`to_rgb` runs later)."""
    try:
        # only the formats a chat request carries: the rarer decoders are attack surface
        image = Image.open(io.BytesIO(data), formats=DECODE_FORMATS)
    except Image.DecompressionBombError as e:
        raise ValueError(f"image refused as a decompression bomb: {e}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, TypeError) as e:
        raise ValueError(f"cannot decode {len(data)} bytes as a PNG, JPEG, WebP or GIF image: {e}") from None
    width, height = image.size  # read from the header; no pixel is decoded yet
    if width * height > max_pixels:
        raise ValueError(f"image is {width}x{height} = {width * height} pixels, over the limit of {max_pixels}")
    try:
        image.load()
        return ImageOps.exif_transpose(image)
    except (OSError, SyntaxError, ValueError) as e:  # a valid header over truncated or corrupt data
        raise ValueError(f"cannot decode the {image.format} image ({width}x{height}): {e}") from None


def expand_placeholders(token_ids: list[int], counts: list[int], image_token_id: int,
                        begin_id: int, end_id: int) -> list[int]:
    """`token_ids` with image i's `begin, image, end` placeholder holding `counts[i]` image tokens.

    Every image token must sit alone between a begin and an end, as the chat template writes it;
    anything else (a stray or an already expanded image token) is refused rather than guessed at.
    """
    out, placeholders, i, n = [], 0, 0, len(token_ids)
    while i < n:
        tok = token_ids[i]
        if tok == begin_id and i + 2 < n and token_ids[i + 1] == image_token_id and token_ids[i + 2] == end_id:
            if placeholders < len(counts):
                if counts[placeholders] < 1:
                    raise ValueError(f"image {placeholders}: token count {counts[placeholders]} is not positive")
                out += [begin_id] + [image_token_id] * counts[placeholders] + [end_id]
            placeholders += 1
            i += 3  # past this image's end, so a begin straight after it starts the next image
            continue
        if tok == image_token_id:
            raise ValueError(f"image token at position {i} is not a lone <|begin_of_image|> <|image|> "
                             "<|end_of_image|> placeholder")
        out.append(tok)
        i += 1
    if placeholders != len(counts):
        raise ValueError(f"the prompt has {placeholders} image placeholders for {len(counts)} images")
    return out
