"""Admission: everything a request is checked against before the engine changes, so a rejected
request leaves no trace (`LLMEngine.add_request`, `check_request`). `self` is the engine."""

from __future__ import annotations

from .request import prompt_token_ids, split_images
from .sampling import SamplingParams


def checked_request(self, prompt, params, request_id):
    """(prompt token ids, params, the prompt's images decoded once), or ValueError saying what is wrong."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    params.validate()   # fields may have been changed since construction
    if params.n != 1:
        raise ValueError(f"an engine request is one sequence (n=1), got n={params.n}; "
                         "fan out with SamplingParams.child(i) as LLM.generate does")
    if request_id is not None and (not isinstance(request_id, str) or not request_id):
        raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
    if request_id is not None and request_id in self.requests:
        raise ValueError(f"duplicate request id {request_id!r}")
    prompt, images = split_images(prompt)
    ids = prompt_token_ids(prompt, self.tokenizer)
    if images:
        ids = self.image_encoder().expand(ids, images)
    if not ids:
        raise ValueError("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < self.model.config.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {self.model.config.vocab_size}): {bad[:5]}")
    total = len(ids) + params.max_tokens
    if total > self.max_model_len:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the "
                         f"model's context length {self.max_model_len}")
    if total > self.plan.max_tokens:
        raise ValueError(f"prompt + max_tokens = {total} tokens exceeds the cache's total capacity "
                         f"{self.plan.max_tokens} tokens; raise --max-memory or lower max_tokens")
    for name in ("forced_prefix_ids", "stop_token_ids"):      # an id past the vocabulary could never be sampled
        ids_ = getattr(params, name, None) or ()
        if ids_ and max(ids_) >= self.model.config.vocab_size:
            raise ValueError(f"{name} out of range [0, {self.model.config.vocab_size}): "
                             f"{[t for t in ids_ if t >= self.model.config.vocab_size][:5]}")
    if self.tokenizer is None and params.stop_list:
        raise ValueError("stop strings need a tokenizer; this checkpoint has none (use stop_token_ids)")
    return ids, params, images
