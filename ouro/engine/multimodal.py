"""Images in a request: the prompt's placeholders expanded, the images encoded into the rows that
replace their tokens' embeddings, and the key the prefix cache matches them by.

A prompt carries one `<|begin_of_image|> <|image|> <|end_of_image|>` per image (as the chat
template writes it); `ImageEncoder.encode` runs the image processor, expands each placeholder to
the image's token count and runs the vision tower (in this process: the single-server and
prefill roles; an encode role runs the same call on its own resources). The rows travel with the
request (`ImageInputs`): a prefill chunk that covers image positions takes their rows instead of
the token embeddings, so chunking, preemption and recompute need nothing else. Two different
images behind the same placeholder ids must never share cache pages: `key_ids` replaces each
image's tokens by a value derived from the image's hash (negative: no real token has it).
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass

import torch


@dataclass
class ImageInputs:
    positions: list[int]          # prompt positions of the image rows, ascending
    embeds: torch.Tensor          # [len(positions), hidden]: the rows that replace those tokens
    hashes: list[str]             # per image: sha256 of its pixels and grid
    counts: list[int]             # per image: its tokens

    def key_ids(self, ids: list[int]) -> list[int]:
        """`ids` with every image token replaced by its image's key (what the prefix cache hashes)."""
        out, k = list(ids), 0
        for h, n in zip(self.hashes, self.counts):
            key = -1 - int(h[:15], 16)
            for p in self.positions[k:k + n]:
                out[p] = key
            k += n
        return out

    def chunk_rows(self, start: int, n: int) -> tuple[list[int], list[int]]:
        """For the chunk of prompt positions [start, start + n): (offsets in the chunk, rows of `embeds`)."""
        lo, hi = bisect.bisect_left(self.positions, start), bisect.bisect_left(self.positions, start + n)
        return [p - start for p in self.positions[lo:hi]], list(range(lo, hi))

    def check(self, ids: list[int], config) -> None:
        """These rows fit the prompt `ids`: one row per image token, the images' spans in order."""
        if image_positions(ids, config) != self.positions or [n for _, n in image_spans(ids, config)] != self.counts:
            raise ValueError(f"the prompt's image tokens do not match the {len(self.counts)} encoded images")
        if self.embeds.shape != (len(self.positions), config.hidden_size):
            raise ValueError(f"image rows of shape {tuple(self.embeds.shape)}, expected "
                             f"({len(self.positions)}, {config.hidden_size})")

    @classmethod
    def from_rows(cls, ids: list[int], config, rows: list[torch.Tensor], hashes: list[str]) -> ImageInputs:
        """Inputs from each image's rows computed elsewhere (an encode worker); the prompt's image
        spans must hold exactly those rows, image by image."""
        spans = image_spans(ids, config)
        counts = [int(r.shape[0]) for r in rows]
        if [n for _, n in spans] != counts or len(hashes) != len(rows):
            raise ValueError(f"the prompt's image spans {[n for _, n in spans]} do not match the images' rows {counts}")
        embeds = torch.cat([r.float() for r in rows]) if rows else torch.empty(0, config.hidden_size)
        return cls(image_positions(ids, config), embeds, list(hashes), counts)


def bytes_hash(raw: bytes) -> str:
    """The key of an encoded image as a client sent it (a router hashes what it forwards, before
    any decoding): equal keys, equal bytes, equal pixels; the same picture re-encoded is a miss."""
    return hashlib.sha256(raw).hexdigest()


def image_hash(pixel_values: torch.Tensor, grid: torch.Tensor) -> str:
    h = hashlib.sha256()
    h.update(str(grid.tolist()).encode())
    h.update(pixel_values.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def as_images(data) -> list:
    """`multi_modal_data["image"]`: one image or a list; each a PIL image or encoded bytes."""
    from ..models.image_processor import load_image
    items = data if isinstance(data, (list, tuple)) else [data]
    out = []
    for i, x in enumerate(items):
        if isinstance(x, (bytes, bytearray)):
            x = load_image(bytes(x))
        elif not hasattr(x, "convert"):
            raise ValueError(f"image {i}: expected a PIL image or encoded image bytes, got {type(x).__name__}")
        out.append(x)
    return out


class ImagePrompt:
    """A checkpoint's image processor and image token ids: what a frontend needs to expand a
    prompt's placeholders (no tower: that runs where the image is encoded)."""

    def __init__(self, model_dir, config):
        from ..models.image_processor import ImageProcessor
        self.config = config
        self.processor = ImageProcessor.from_dir(model_dir)

    def counts(self, sizes: list[tuple[int, int]]) -> list[int]:
        """Image tokens of each image of (height, width)."""
        return self.processor.tokens_per_image(torch.tensor([self.processor.grid(h, w) for h, w in sizes]))

    def expand(self, ids: list[int], images: list) -> list[int]:
        """The prompt with each image placeholder expanded to that image's token count (sizes
        only: a request is checked before anything expensive runs). A prompt already expanded
        to these counts (a frontend did it) is returned as it is."""
        from ..models.image_processor import expand_placeholders
        c = self.config
        counts = self.counts([(im.height, im.width) for im in images])
        spans = image_spans(ids, c)
        if [n for _, n in spans] == counts:
            return list(ids)
        return expand_placeholders(ids, counts, c.image_token_id, c.image_start_token_id, c.image_end_token_id)


class ImageEncoder(ImagePrompt):
    """`ImagePrompt` with the checkpoint's vision tower: the encode step."""

    def __init__(self, model_dir, config, dtype=torch.float32, device="cpu"):
        from ..models.loader import load_vision
        super().__init__(model_dir, config)
        self.tower = load_vision(model_dir, dtype=dtype)
        if self.tower is None:
            raise ValueError(f"{model_dir} has no vision tower (no model.visual.* tensors): it takes text only")
        self.tower = self.tower.to(device).eval()

    @torch.inference_mode()
    def encode_images(self, images: list) -> tuple[list[torch.Tensor], list[str]]:
        """Each image's rows (float32) and its pixel hash: processor, then the vision tower."""
        pixels, grid = self.processor(images)
        counts = [int(n) for n in self.processor.tokens_per_image(grid)]
        embeds = self.tower(pixels.to(next(self.tower.parameters()).dtype), grid).float()
        if sum(counts) != embeds.shape[0]:
            raise ValueError(f"the tower gave {embeds.shape[0]} rows for {sum(counts)} image tokens")
        patches = [int(t * h * w) for t, h, w in grid.tolist()]
        hashes, start = [], 0
        for g, p in zip(grid, patches):
            hashes.append(image_hash(pixels[start:start + p], g))
            start += p
        return list(embeds.split(counts)), hashes

    def encode(self, ids: list[int], images: list, hashes: list[str] | None = None) -> ImageInputs:
        """The image rows of an expanded prompt (`expand`); `hashes`: the images' keys when the
        caller has them (a router's `bytes_hash`), else their pixel hashes."""
        rows, pixel_hashes = self.encode_images(images)
        return ImageInputs.from_rows(ids, self.config, rows, hashes or pixel_hashes)


def image_spans(ids: list[int], config) -> list[tuple[int, int]]:
    """(first position, count) of the image tokens of each `<|begin_of_image|> ... <|end_of_image|>` span."""
    out, start = [], None
    for p, t in enumerate(ids):
        if t == config.image_start_token_id:
            start = p + 1
        elif t == config.image_end_token_id and start is not None:
            n = p - start
            if any(x != config.image_token_id for x in ids[start:p]):
                raise ValueError(f"an image span at position {start - 1} holds tokens other than the image token")
            out.append((start, n))
            start = None
    return out


def image_positions(ids: list[int], config) -> list[int]:
    """Positions of the image tokens inside the image spans, ascending."""
    return [s + k for s, n in image_spans(ids, config) for k in range(n)]
