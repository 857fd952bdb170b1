"""`/tokenize` and `/detokenize` in vLLM's and SGLang's shapes (both in the OpenAPI schema):

    POST /tokenize    {"prompt": text} or {"messages": [...], "add_generation_prompt": true},
                      "add_special_tokens" (prompt only), "return_token_strs"
                      -> {"tokens": [ids], "count", "max_model_len", "token_strs" (when asked)}
    POST /detokenize  {"tokens": [ids]} -> {"prompt": text, "text": text}   (vLLM's key, SGLang's key)
    GET /tokenizer_info -> the checkpoint's tokenizer_config.json as vLLM's route returns it
                      (`tokenizer_class`, `eos_token`, `bos_token`, `pad_token`, `chat_template`, ...;
                      no file paths): with /tokenize and /detokenize what lm-eval's `remote`
                      tokenizer backend reads, so it needs no local copy of the tokenizer

Token ids outside the vocabulary are a 400; a chat needs the checkpoint's chat template; a model
name other than the served one is a 404."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import ConfigDict, Field

from .protocol import Body, ChatMessage, ServeError, TokenId, bound, check_model


class TokenizeRequest(Body):
    # extra: protocol.py's one rule for fields; oneOf: a prompt or a chat, not both
    model_config = ConfigDict(extra="forbid", json_schema_extra={"oneOf": [
        {"properties": {"prompt": {"type": "string"}}, "required": ["prompt"]},
        {"properties": {"messages": {"type": "array"}}, "required": ["messages"]}]})
    model: str | None = Field(None, json_schema_extra=bound("model"))
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Body):
    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, json_schema_extra=bound("model"))
    tokens: list[TokenId] = Field(max_length=1 << 20)


SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")
FILE_KEYS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")


def tokenizer_info(directory, tokenizer, chat=None, eos_token_ids=()) -> dict:
    """What GET /tokenizer_info answers: the checkpoint's tokenizer_config.json without file paths,
    special tokens as text (their `content`; `eos_token` from the model's eos ids when the config
    names none, the key always present: lm-eval checks for it), `tokenizer_class`, and the chat
    template the server renders with (its default when the checkpoint names several)."""
    path = Path(directory) / "tokenizer_config.json"
    info = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    for key in FILE_KEYS:
        info.pop(key, None)
    for key in SPECIAL:
        value = info.get(key)
        info[key] = value.get("content") if isinstance(value, dict) else value
    if info["eos_token"] is None and eos_token_ids:
        info["eos_token"] = tokenizer.id_to_token(eos_token_ids[0])
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    source = getattr(getattr(chat, "template", None), "source", None)
    if isinstance(source, dict):
        source = source.get("default")
    if source:
        info["chat_template"] = source
    return info


def add_tokenize_routes(app, state) -> None:
    @app.get("/tokenizer_info")
    async def get_tokenizer_info():
        return state.tokenizer_info

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(state, body.model)
        return await asyncio.to_thread(_tokenize, state, body)   # off the event loop, as a generation's prompt

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(state, body.model)
        bad = [t for t in body.tokens if t >= state.vocab_size]
        if bad:
            raise ServeError(400, f"token ids out of range [0, {state.vocab_size}): {bad[:5]}")
        text = await asyncio.to_thread(state.tokenizer.decode, body.tokens, skip_special_tokens=False)
        return {"prompt": text, "text": text}


def _tokenize(state, body: TokenizeRequest) -> dict:
    """/tokenize's work: a prompt's ids, or a chat's through the checkpoint's template."""
    if (body.prompt is None) == (body.messages is None):
        raise ServeError(400, "give either prompt (text) or messages (a chat)")
    if body.prompt is not None:
        ids = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens).ids
    else:
        if state.chat is None:
            raise ServeError(400, "this checkpoint has no chat template; tokenize a prompt instead")
        chat = _ChatBody(body)
        try:
            text = state.chat.render(chat).text
        except ValueError as e:
            raise ServeError(400, f"cannot apply the chat template: {e}") from None
        ids = state.tokenizer.encode(text, add_special_tokens=False).ids
    out = {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}
    if body.return_token_strs:
        out["token_strs"] = [state.tokenizer.id_to_token(i) for i in ids]
    return out


class _ChatBody:
    """What `ChatFormat.render` reads of a chat request, from a /tokenize body."""

    def __init__(self, body: TokenizeRequest):
        self.messages, self.add_generation_prompt = body.messages, body.add_generation_prompt
        self.chat_template_kwargs, self.reasoning_effort = body.chat_template_kwargs, None
        self.tools, self.tool_choice = None, None
