"""A request's lifetime in the engine: its tokens, cache holdings and state."""

from __future__ import annotations

import enum
import numbers
import time
from dataclasses import dataclass, field

import torch


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)     # one request is one object: compared (`in`, `remove`) by identity, not field by field
class Request:
    request_id: str
    prompt_ids: list[int]
    params: "SamplingParams"  # noqa: F821
    generator: torch.Generator | None = None
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None  # when it first got a slot (queue time = this - arrival)
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    num_computed: int = 0          # tokens whose KV / state are in the cache
    pages: list[int] = field(default_factory=list)
    slot: int | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cached_tokens: int = 0         # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    detokenizer: object | None = None
    prefix_match: object | None = None   # locked prefix-cache match, released when pages are freed
    restore_from: int | None = None      # KDA checkpoint to copy into the slot before computing
    # params.prompt_logprobs set: one entry per prompt token (entry 0 None), filled during prefill
    prompt_logprobs: list | None = None
    prompt_ranks: list | None = None     # ... and the rank of each prompt token among them (vLLM's `rank`)
    hold_on_finish: bool = False         # keep pages and slot after finishing until Scheduler.release
    # speculative decoding: the drafts the next step verifies, their draft distributions [K, V]
    # (sampled rows), and what the verifying forward's KDA layers recorded for the commit
    draft_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    spec_record: object | None = None
    spec_counts: list = field(default_factory=lambda: [0, 0, 0])   # verifications, tokens emitted, drafts verified
    spec_off: bool = False               # the online canary stopped this request's speculation
    mm: object | None = None             # an `engine.multimodal.ImageInputs`: the prompt's image rows
    constraint: object | None = None     # an `engine.structured.Constraint`: the output's grammar matcher

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def key_ids(self) -> list[int]:
        """What the prefix cache matches: the tokens, each image's tokens keyed by that image."""
        return self.all_ids if self.mm is None else self.mm.key_ids(self.prompt_ids) + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class RequestOutput:
    """What `LLMEngine.step` reports for one request: the new tokens since the last report."""
    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    prompt_token_ids: list[int]
    cached_tokens: int
    logprobs: list[float]
    top_logprobs: list
    queue_time: float | None = None   # seconds from arrival to first scheduling
    # with SamplingParams.prompt_logprobs: [None, {token_id: logprob, ...}, ...], one per prompt token
    prompt_logprobs: list | None = None
    prompt_ranks: list | None = None   # [None, rank of prompt token 1, ...]


class RequestFailed(RuntimeError):
    """One request cannot go on (e.g. its context-parallel prefill lost a rank): the engine
    releases it and reports this; the other requests are not affected. `status`: the HTTP status a
    server answers with (400: the request's own fault, e.g. a grammar that does not compile)."""

    def __init__(self, request_id: str, message: str, status: int = 500):
        super().__init__(message)
        self.request_id, self.status = request_id, status


def token_id_list(ids) -> list[int]:
    """A list (or tuple) of integer token ids, taken as is: no coercion of strings or floats."""
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"prompt_token_ids must be a list of integers, got {type(ids).__name__}")
    # `type(t) is int` first: the abstract-class check alone took ~1.2 us a token (10 ms for 16 x 512)
    bad = [t for t in ids if type(t) is not int and (isinstance(t, bool) or not isinstance(t, numbers.Integral))]
    if bad:
        raise ValueError(f"prompt_token_ids must be integers; got {bad[0]!r} ({type(bad[0]).__name__})")
    return [int(t) for t in ids]


def split_images(prompt):
    """(the prompt without its images, the images or None): a prompt with images is
    {"prompt": text or "prompt_token_ids": ids, "multi_modal_data": {"image": one or a list}}."""
    if not isinstance(prompt, dict) or "multi_modal_data" not in prompt:
        return prompt, None
    rest = {k: v for k, v in prompt.items() if k != "multi_modal_data"}
    data = prompt["multi_modal_data"]
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise ValueError(f"multi_modal_data takes {{'image': image or [images]}}, got "
                         f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
    if set(rest) == {"prompt"}:
        rest = rest["prompt"]
    from .multimodal import as_images          # the image machinery, only for a prompt that has images
    images = as_images(data.get("image", []))
    return rest, images or None


def prompt_token_ids(prompt, tokenizer) -> list[int]:
    """A prompt as a request takes it: text (through `tokenizer`), a list of ids, or
    {'prompt_token_ids': [...]}; anything else is a ValueError saying what is expected."""
    if isinstance(prompt, dict):
        if set(prompt) != {"prompt_token_ids"}:
            raise ValueError(f"a token prompt is {{'prompt_token_ids': [int, ...]}}, got keys {sorted(prompt)}")
        return token_id_list(prompt["prompt_token_ids"])
    if isinstance(prompt, (list, tuple)):
        return token_id_list(prompt)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer (tokenizer.json missing): "
                             "pass {'prompt_token_ids': [...]} instead of text")
        return tokenizer.encode(prompt).ids
    raise ValueError(f"a prompt is a string or {{'prompt_token_ids': [int, ...]}}, got {type(prompt).__name__}")
