"""Held-out bits/byte through ouro's own engine, and the same figure from transformers.

A document is scored as `<|endoftext|>` + its tokens (see `corpus.py`). That sequence s is cut
into windows s[j*L : j*L + L + 1] (L = context_len): each window is one engine request with
`prompt_logprobs=0`, and its positions 1.. are scored, so every token of the document is
predicted exactly once, from at most L tokens of context. bits = -sum(logprob) / ln 2;
bits/byte = total bits / total UTF-8 bytes of the documents.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from .corpus import Document

END_OF_TEXT = "<|endoftext|>"


@dataclass
class PplResult:
    bits_per_byte: float
    nll_bits: float          # total negative log-likelihood, in bits
    n_bytes: int             # UTF-8 bytes of the documents
    n_tokens: int            # tokens predicted (each document's tokens, not the leading <|endoftext|>)
    n_documents: int
    n_windows: int
    seconds: float


def document_ids(tokenizer, text: str) -> list[int]:
    """`<|endoftext|>` + the text's tokens: the sequence a document is scored as."""
    eot = tokenizer.token_to_id(END_OF_TEXT)
    if eot is None:
        raise ValueError(f"the tokenizer has no {END_OF_TEXT} token to start documents with")
    return [eot] + tokenizer.encode(text, add_special_tokens=False).ids


def windows(ids: list[int], context_len: int) -> list[list[int]]:
    """s[j*L : j*L + L + 1] for every j with something left to predict: each of ids[1:] is the
    target of exactly one window position."""
    return [ids[j:j + context_len + 1] for j in range(0, len(ids) - 1, context_len)]


def _windows(tokenizer, documents: list[Document], context_len: int):
    if isinstance(context_len, bool) or not isinstance(context_len, int) or context_len < 1:
        raise ValueError(f"context_len must be an integer >= 1, got {context_len!r}")
    if not documents:
        raise ValueError("no documents to score")
    wins, n_tokens = [], 0
    for doc in documents:
        ids = document_ids(tokenizer, doc.text)
        n_tokens += len(ids) - 1
        wins += windows(ids, context_len)
    return wins, n_tokens, sum(d.n_bytes for d in documents)


def _result(window_nll_nats: list[float], n_tokens: int, n_bytes: int, n_documents: int, seconds: float):
    bits = math.fsum(window_nll_nats) / math.log(2)
    return PplResult(bits / n_bytes, bits, n_bytes, n_tokens, n_documents, len(window_nll_nats), seconds)


def evaluate_bits_per_byte(llm_or_engine, tokenizer, documents: list[Document], context_len: int = 1024,
                           progress: bool = True) -> PplResult:
    """Bits/byte of `documents` under the engine's model (an `LLM` or an `LLMEngine`). All
    windows are queued at once, so the engine batches them; on any exception they are aborted."""
    from tqdm import tqdm

    from ..engine.sampling import SamplingParams
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
    if tokenizer is None:
        raise ValueError("bits/byte needs a tokenizer and the checkpoint has none (tokenizer.json)")
    wins, n_tokens, n_bytes = _windows(tokenizer, documents, context_len)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    start = time.perf_counter()
    for w in wins:                         # every window checked before any is queued
        engine.check_request(w, params)
    tag = f"ppl-{time.monotonic_ns():x}"
    rids = [f"{tag}-{i}" for i in range(len(wins))]
    wanted = set(rids)
    nll: dict[str, float] = {}
    bar = tqdm(total=len(wins), desc="bits/byte", unit="window", disable=not progress)
    try:
        for rid, w in zip(rids, wins):
            engine.add_request(w, params, rid)
        while len(nll) < len(rids):
            for out in engine.step():
                if out.finished and out.request_id in wanted:
                    plp, ids = out.prompt_logprobs, out.prompt_token_ids
                    nll[out.request_id] = -math.fsum(plp[i][ids[i]] for i in range(1, len(ids)))
                    bar.update(1)
            if not engine.has_unfinished() and len(nll) < len(rids):
                raise RuntimeError(f"the engine finished with {len(rids) - len(nll)} windows unscored")
    except BaseException:
        for rid in rids:
            engine.abort(rid)
        raise
    finally:
        bar.close()
    return _result([nll[r] for r in rids], n_tokens, n_bytes, len(documents), time.perf_counter() - start)


def transformers_bits_per_byte(model_dir, tokenizer, documents: list[Document], context_len: int = 1024,
                               dtype="float32", device: str = "cpu", progress: bool = False) -> PplResult:
    """The same windows scored by transformers' `Glm5NextForConditionalGeneration` (a plain
    forward per window, float32 log-softmax of its logits): the reference for the engine's figure.
    transformers is an optional dependency, imported only here."""
    import torch
    from tqdm import tqdm
    try:
        from transformers import Glm5NextForConditionalGeneration
    except ImportError as e:
        raise ValueError(f"comparing with transformers needs transformers >= 5.24 installed ({e})") from None
    if tokenizer is None:
        from ..models.resolve import load_tokenizer
        tokenizer = load_tokenizer(model_dir)
        if tokenizer is None:
            raise ValueError(f"checkpoint {model_dir} has no tokenizer.json")
    wins, n_tokens, n_bytes = _windows(tokenizer, documents, context_len)
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = Glm5NextForConditionalGeneration.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
    start = time.perf_counter()           # scoring time, as for the engine: loading not counted
    nll = []
    with torch.no_grad():
        for w in tqdm(wins, desc="transformers", unit="window", disable=not progress):
            logits = model(torch.tensor([w], device=device), use_cache=False).logits[0].float()
            logp = logits[:-1].log_softmax(dim=-1)
            target = torch.tensor(w[1:], device=logp.device)
            nll.append(-float(logp.gather(-1, target[:, None]).double().sum()))
    return _result(nll, n_tokens, n_bytes, len(documents), time.perf_counter() - start)


def format_result(r: PplResult, system: str, dtype: str) -> str:
    return (f"held-out bits/byte {r.bits_per_byte:.4f} ({system}, {dtype}; {r.n_documents} files, "
            f"{r.n_bytes:,} bytes, {r.n_tokens:,} tokens, {r.seconds:.1f} s)")
