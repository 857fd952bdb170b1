"""OpenAI requests -> engine jobs: a completion or chat body's prompt ids (chat templates and
images applied), one SamplingParams per choice, its stop strings. Its bad parts get a 400
(`ServeError`). The jobs' outputs are rendered by `response_view.py`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pydantic import ValidationError

from ..engine.sampling import SamplingParams
from .protocol import ServeError
from .structured_request import spec_for


@dataclass
class Job:
    prompt_ids: list[int]
    child_params: list            # one SamplingParams (n=1) per choice
    stop: list[str]
    skip_special_tokens: bool
    parser_factory: object = None  # chat: () -> streaming output parser per choice
    choice_base: int = 0           # index of this job's first choice in the response
    images: list | None = None     # encoded images (bytes), in prompt order
    echo: str | None = None        # completions' echo: the prompt's text, before each choice's


def _max_tokens(state, body, n_prompt: int) -> int:
    want = getattr(body, "max_completion_tokens", None) or body.max_tokens
    return want if want is not None else max(1, min(state.max_model_len, state.capacity_tokens) - n_prompt)


def _stops(body) -> list[str]:
    if body.stop is None:
        return []
    return [body.stop] if isinstance(body.stop, str) else list(body.stop)


def sampling_for(body, max_tokens: int, logprobs: int | None, stop_token_ids=None, structured=None,
                 prompt_logprobs: int | None = None) -> SamplingParams:
    """The engine params of one request (stop strings stay in the frontend)."""
    try:
        return SamplingParams(n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                              min_p=body.min_p, seed=body.seed, max_tokens=max_tokens,
                              stop_token_ids=list(stop_token_ids or []) or None, ignore_eos=body.ignore_eos,
                              logprobs=logprobs, structured=structured, prompt_logprobs=prompt_logprobs)
    except (ValueError, ValidationError) as e:
        raise ServeError(400, str(e)) from None


def _children(body, params) -> list:
    return [params.child(k) for k in range(body.n)]


def completion_jobs(state, body) -> list[Job]:
    p = body.prompt
    if isinstance(p, str):
        prompts = [p]
    elif p and all(isinstance(x, str) for x in p):
        prompts = list(p)
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(p)]
    elif p and all(isinstance(x, list) for x in p):
        prompts = [list(x) for x in p]
    else:
        raise ServeError(400, "prompt must be a string, a list of strings, a list of token ids or a list of lists of ids")
    # the prompt's logprobs: top k for echo's logprobs, and vLLM's prompt_logprobs
    wanted = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
    jobs = []
    for i, pr in enumerate(prompts):
        ids = state.tokenizer.encode(pr).ids if isinstance(pr, str) else pr
        params = sampling_for(body, _max_tokens(state, body, len(ids)), body.logprobs, body.stop_token_ids,
                              spec_for(state, body), max(wanted, default=None))
        echo = (pr if isinstance(pr, str) else state.tokenizer.decode(ids, skip_special_tokens=False)) \
            if body.echo else None
        jobs.append(Job(ids, _children(body, params), _stops(body), True, choice_base=i * body.n, echo=echo))
    return jobs


def chat_jobs(state, body) -> list[Job]:
    if state.chat is None:
        raise ServeError(400, "this checkpoint has no chat template; use /v1/completions")
    from .media import check_parts, collect_images, has_images
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    check_parts(messages)
    if state.images is None and has_images(messages):
        raise ServeError(400, "this model takes text only: it has no vision tower")
    messages, images = collect_images(messages, state.media) if state.media is not None else (messages, [])
    try:
        rendered = state.chat.render(body, messages)
    except ValueError as e:
        raise ServeError(400, f"cannot apply the chat template: {e}") from None
    ids = state.tokenizer.encode(rendered.text, add_special_tokens=False).ids
    if images:
        ids = expand_images(state, ids, images)
    top = body.top_logprobs if body.logprobs else None
    if body.top_logprobs and not body.logprobs:
        raise ServeError(400, "top_logprobs needs logprobs: true")
    spec = spec_for(state, body, rendered)
    params = sampling_for(body, _max_tokens(state, body, len(ids)), (top or 0) if body.logprobs else None,
                          body.stop_token_ids, spec, body.prompt_logprobs)
    if rendered.forced_prefix and not (spec and spec["type"] == "structural_tag"):   # a strict call's tag forces it
        forced = state.tokenizer.encode(rendered.forced_prefix, add_special_tokens=False).ids
        if len(forced) >= params.max_tokens:
            raise ServeError(400, f"tool_choice needs max_tokens > {len(forced)} to open the tool call")
        params = dataclasses.replace(params, forced_prefix_ids=forced)
    return [Job(ids, _children(body, params), _stops(body), False,
                parser_factory=lambda: state.chat.parser(body, rendered), images=images or None)]


def expand_images(state, ids: list[int], images: list[bytes]) -> list[int]:
    """The prompt's image placeholders at each image's token count (from its size)."""
    from ..models.image_processor import load_image
    try:
        return state.images.expand(ids, [load_image(raw) for raw in images])
    except ValueError as e:
        raise ServeError(400, f"images: {e}") from None
