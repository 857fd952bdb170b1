"""Shared by the image tests: PNGs from a seed, data URIs, offline generation with images (the
reference a server must equal), and the planted 'image rows one position late' fault, in process."""

import base64
import io

import numpy as np

from ouro.config import EngineConfig
from ouro.engine.llm_engine import LLMEngine
from ouro.engine.multimodal import ImageInputs
from ouro.engine.sampling import SamplingParams
from ouro.models.loader import load_model
from ouro.models.resolve import load_tokenizer, resolve_model
from ouro.serve.chat_template import ChatTemplate


def png(h: int, w: int, seed: int) -> bytes:
    from PIL import Image
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def data_uri(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def offline_tokens(messages, images: list[bytes], n: int) -> list[int]:
    d = resolve_model("tiny-vl")
    text = ChatTemplate.from_checkpoint(d).render(messages)
    tok = load_tokenizer(d)
    eng = LLMEngine(load_model(d), tok, EngineConfig(max_memory=64 << 20, page_size=16), verbose=False, model_dir=d)
    eng.add_request({"prompt_token_ids": tok.encode(text, add_special_tokens=False).ids,
                     "multi_modal_data": {"image": images}}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    out = None
    while eng.has_unfinished():
        for o in eng.step():
            out = o if o.finished else out
    return out.token_ids




def rows_one_position_late(monkeypatch) -> None:
    """Every image row of a chunk written one position after its image token (dropped at the chunk's end)."""
    real = ImageInputs.chunk_rows

    def late(self, start, n):
        offsets, rows = real(self, start, n)
        keep = [(o + 1, r) for o, r in zip(offsets, rows) if o + 1 < n]
        return [o for o, _ in keep], [r for _, r in keep]
    monkeypatch.setattr(ImageInputs, "chunk_rows", late)
