"""Token streams for training and windows for evaluation, from corpus documents.

Documents are framed and windowed exactly as `ouro eval ppl` scores them (`eval.ppl.document_ids`,
`eval.ppl.windows`). Training batches are windows at offsets drawn from a generator seeded by
(seed, step), so a run resumed at step k sees exactly the batches an uninterrupted run would."""

from __future__ import annotations

import torch

from ..eval.ppl import document_ids as scored_ids
from ..eval.ppl import windows


def document_ids(tokenizer, documents) -> list[list[int]]:
    return [scored_ids(tokenizer, d.text) for d in documents]


def token_stream(tokenizer, documents) -> torch.Tensor:
    return torch.tensor([t for doc in document_ids(tokenizer, documents) for t in doc], dtype=torch.long)


def batch_at(stream: torch.Tensor, step: int, seed: int, batch_size: int, window: int) -> torch.Tensor:
    if len(stream) <= window:
        raise ValueError(f"the training corpus has {len(stream)} tokens, fewer than one window of {window}; "
                         "use a larger corpus or a shorter --seq-len")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(stream) - window, (batch_size,), generator=gen)
    return torch.stack([stream[s:s + window] for s in starts.tolist()])


def eval_windows(doc_ids: list[list[int]], length: int) -> list[torch.Tensor]:
    return [torch.tensor(w, dtype=torch.long) for ids in doc_ids for w in windows(ids, length)]
