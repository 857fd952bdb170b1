"""`POST /v1/responses`: OpenAI's Responses API over the chat path, whole and streamed, with tools.

A Responses request becomes a chat completion request (`to_chat`): `instructions` a system
message; `input` text, or items: messages (`input_text`, `input_image`, `output_text` parts),
`function_call` items (an assistant's tool calls) and `function_call_output` items (tool
results); function tools (flat in this API) and `tool_choice`; `text.format` the response format
(structured outputs); `reasoning.effort`; `max_output_tokens`. The chat reply becomes the response
(`to_response`): a reasoning item when there is reasoning, a message item with its `output_text`,
a `function_call` item per tool call; `status` "incomplete" with `max_output_tokens` when cut.
Streamed, the chat chunks become the API's events (`responses_stream.py`), with the same item
shapes (`_item`). Nothing is stored: `previous_response_id` is refused.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Field, WithJsonSchema, model_validator

from .protocol import ARGUMENTS_TEXT, REASONING_EFFORT, Body, ChatCompletionRequest, ServeError, Text, bound, only, rule


class ResponseTool(Body):
    type: Literal["function"] = "function"
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedResponseTool(Body):
    type: Literal["function"] = "function"
    name: str


class TextPart(Body):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None


class ImagePart(Body):
    type: Literal["input_image"]
    image_url: str
    detail: str | None = None


class _Item(Body):
    id: str | None = None             # what a client echoes back from an earlier response
    status: str | None = None


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]]]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: Text
    arguments: Annotated[str, WithJsonSchema(ARGUMENTS_TEXT)] = Field("{}", description="the JSON text of an object")


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class TextFormat(Body):
    """`json_schema` carries its schema (as chat's response_format)."""
    model_config = ConfigDict(json_schema_extra=rule({"type": {"const": "json_schema"}}, {
        "properties": {"schema": {"type": "object"}}, "required": ["schema"]}))
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("text.format of type json_schema needs its schema")
        return self


class TextConfig(Body):
    format: TextFormat | None = None


class ReasoningConfig(Body):
    effort: REASONING_EFFORT | None = None
    summary: str | None = None


class ResponsesRequest(Body):
    # extra: protocol.py's one rule for fields; the rule: a forced call needs tools, as the chat route's
    model_config = ConfigDict(extra="forbid", json_schema_extra=rule(
        {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}},
        {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]}))
    model: str | None = Field(None, json_schema_extra=bound("model"))
    input: Union[Text, Annotated[list[Union[MessageItem, FunctionCallItem, FunctionCallOutputItem]], Field(min_length=1)]]
    instructions: str | None = None
    tools: list[ResponseTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedResponseTool, None] = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    previous_response_id: only(str | None, {"type": "null"}, lambda v: v is None,
                               "previous_response_id is not supported: ouro stores no responses; send the input items") = None
    user: str | None = None


def _parts(content) -> Union[str, list[dict]]:
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": p.text} if isinstance(p, TextPart) else
            {"type": "image_url", "image_url": {"url": p.image_url}} for p in content]


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    messages: list[dict] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _parts(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments or "{}"}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "temperature": body.temperature,
                            "top_p": body.top_p, "stream": body.stream}
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    if body.max_output_tokens is not None:
        chat["max_tokens"] = body.max_output_tokens
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in body.tools]
    if body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice if isinstance(body.tool_choice, str) else \
            {"type": "function", "function": {"name": body.tool_choice.name}}
    if body.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(
            exclude_none=True, by_alias=True, include={"name", "schema_", "strict", "description"})}
    elif fmt is not None:
        chat["response_format"] = {"type": fmt.type}
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["reasoning_effort"] = body.reasoning.effort
    try:
        return ChatCompletionRequest.model_validate(chat)
    except Exception as e:          # a pydantic ValidationError: what the chat path would say
        raise ServeError(400, f"the request does not make a chat request: {e}"[:600]) from None


def _envelope(body: ResponsesRequest, rid: str, created: int, model: str) -> dict:
    return {"id": rid, "object": "response", "created_at": created, "model": model, "status": "in_progress",
            "output": [], "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "tool_choice": body.tool_choice if isinstance(body.tool_choice, str) or body.tool_choice is None
            else body.tool_choice.model_dump(), "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": body.text.model_dump(exclude_none=True, by_alias=True) if body.text else {"format": {"type": "text"}}, "metadata": body.metadata or {}, "store": False,
            "usage": None}


def _items(message: dict, rid: str) -> list[dict]:
    """The reply's output items (`_item`'s shapes, which the stream opens and closes too)."""
    entries = []
    if message.get("reasoning_content"):
        entries.append({"kind": "reasoning", "id": f"rs_{rid}", "text": message["reasoning_content"]})
    if message.get("content") or not message.get("tool_calls"):
        entries.append({"kind": "message", "id": f"msg_{rid}", "text": message.get("content") or ""})
    for c in message.get("tool_calls") or []:
        entries.append({"kind": "function_call", "id": c["id"], "name": c["function"]["name"],
                        "arguments": c["function"]["arguments"]})
    return [_item(e, "completed") for e in entries]


def _usage(u: dict | None) -> dict | None:
    if not u:
        return None
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _finish(resp: dict, finish_reason: str | None) -> dict:
    cut = finish_reason == "length"
    resp["status"] = "incomplete" if cut else "completed"
    resp["incomplete_details"] = {"reason": "max_output_tokens"} if cut else None
    return resp


def to_response(body: ResponsesRequest, chat: dict) -> dict:
    rid = "resp_" + uuid.uuid4().hex
    choice = chat["choices"][0]
    resp = _envelope(body, rid, chat.get("created", int(time.time())), chat["model"])
    resp["output"] = _items(choice["message"], rid[5:])
    resp["usage"] = _usage(chat.get("usage"))
    return _finish(resp, choice.get("finish_reason"))


_PREFIX = {"reasoning": "rs_", "message": "msg_"}


def _part(e: dict, text: str) -> dict:
    if e["kind"] == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": []}


def _item(e: dict, status: str) -> dict:
    """An opened item as the response lists it (`_items`' shapes), `status` while in progress."""
    if e["kind"] == "function_call":
        return {"type": "function_call", "id": f"fc_{e['id']}", "call_id": e["id"], "name": e["name"],
                "arguments": e["arguments"] if status == "completed" else "", "status": status}
    text = e["text"] if status == "completed" else None
    if e["kind"] == "reasoning":
        return {"type": "reasoning", "id": e["id"], "summary": [], "content": [] if text is None else [_part(e, text)]}
    return {"type": "message", "id": e["id"], "status": status, "role": "assistant",
            "content": [] if text is None else [_part(e, text)]}
