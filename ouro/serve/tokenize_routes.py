"""`/tokenize` and `/detokenize` in vLLM's and SGLang's shapes (both in the OpenAPI schema):

    POST /tokenize    {"prompt": text} or {"messages": [...], "add_generation_prompt": true},
                      "add_special_tokens" (prompt only), "return_token_strs"
                      -> {"tokens": [ids], "count", "max_model_len", "token_strs" (when asked)}
    POST /detokenize  {"tokens": [ids]} -> {"prompt": text, "text": text}   (vLLM's key, SGLang's key)

Token ids outside the vocabulary are a 400; a chat needs the checkpoint's chat template."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from .protocol import Body, ChatMessage, ServeError, TokenId, bound


class TokenizeRequest(Body):
    model_config = ConfigDict(json_schema_extra={"oneOf": [     # a prompt or a chat, not both
        {"properties": {"prompt": {"type": "string"}}, "required": ["prompt"]},
        {"properties": {"messages": {"type": "array"}}, "required": ["messages"]}]})
    model: str | None = Field(None, json_schema_extra=bound("model"))
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Body):
    model: str | None = Field(None, json_schema_extra=bound("model"))
    tokens: list[TokenId] = Field(max_length=1 << 20)


def add_tokenize_routes(app, state) -> None:
    def check_model(body):
        if body.model is not None and body.model != state.model_name:
            raise ServeError(400, f"the model {body.model!r} does not exist; this server serves {state.model_name!r}")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body)
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

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body)
        bad = [t for t in body.tokens if t >= state.vocab_size]
        if bad:
            raise ServeError(400, f"token ids out of range [0, {state.vocab_size}): {bad[:5]}")
        text = state.tokenizer.decode(body.tokens, skip_special_tokens=False)
        return {"prompt": text, "text": text}


class _ChatBody:
    """What `ChatFormat.render` reads of a chat request, from a /tokenize body."""

    def __init__(self, body: TokenizeRequest):
        self.messages, self.add_generation_prompt = body.messages, body.add_generation_prompt
        self.chat_template_kwargs, self.reasoning_effort = body.chat_template_kwargs, None
        self.tools, self.tool_choice = None, None
