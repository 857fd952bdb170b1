"""Token streams for training and windows for evaluation, from corpus documents.

Each document is `<|endoftext|>` + its tokens (the same framing `ouro eval ppl` scores). Training
batches are windows at offsets drawn from a generator seeded by (seed, step), so a run resumed at
step k sees exactly the batches an uninterrupted run would."""

from __future__ import annotations

import torch

EOS_ID = 0


def document_ids(tokenizer, documents) -> list[list[int]]:
    enc = tokenizer.encode_batch([d.text for d in documents], add_special_tokens=False)
    return [[EOS_ID] + e.ids for e in enc]


def token_stream(tokenizer, documents) -> torch.Tensor:
    ids = document_ids(tokenizer, documents)
    return torch.tensor([t for doc in ids for t in doc], dtype=torch.long)


def batch_at(stream: torch.Tensor, step: int, seed: int, batch_size: int, window: int) -> torch.Tensor:
    if len(stream) <= window:
        raise ValueError(f"the training corpus has {len(stream)} tokens, fewer than one window of {window}; "
                         "use a larger corpus or a shorter --seq-len")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(stream) - window, (batch_size,), generator=gen)
    return torch.stack([stream[s:s + window] for s in starts.tolist()])


def eval_windows(doc_ids: list[list[int]], length: int) -> list[torch.Tensor]:
    """Each document cut into windows s[j*L : j*L+L+1]; scoring positions 1.. of every window
    predicts every token of the document exactly once."""
    out = []
    for s in doc_ids:
        for j in range(0, len(s) - 1, length):
            out.append(torch.tensor(s[j:j + length + 1], dtype=torch.long))
    return out
