"""OpenAI request bodies (pydantic) and the error body. Every refusal a body can earn by its own
content is declared here, so the published schema (`openapi.py`) is what the server takes:
ranges, non-empty prompts and lists, the one value an accepted-but-unimplemented OpenAI field
may have, and the cross-field rules JSON Schema can state (`if`/`then`, `RULES`). A bad value is
a 400 naming the field, never an exception deeper in.

One rule for fields (completions and chat): a field is honoured or refused, never ignored. A
field these bodies do not declare (a made-up one, or one of vLLM's ouro does not implement) is a
400 naming it (`additionalProperties: false`); a declared OpenAI / vLLM field ouro does not
implement (`best_of`, `min_tokens`, `repetition_penalty`, `truncate_prompt_tokens`, `logit_bias`,
penalties, `suffix`) takes only the value that asks for nothing, and any other is a 400 naming it.

Limits that are the server's own (its vocabulary, context length, model name) are marked with
`bound(kind)`: `openapi.py` writes the number into the schema and `api_server` refuses beyond it
with OpenAI's messages. What JSON Schema cannot state (a prompt's tokens plus max_tokens within
the context; a named tool_choice naming one of the tools; a forced tool call's tag within
max_tokens) is said in the field's description, and a past tool call's string arguments being the
JSON text of an object in `contentMediaType`/`contentSchema` (annotations validators skip)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema,
                      WrapValidator, model_validator)

from ..engine.sampling import MAX_LOGPROBS
from .chat_template import TEMPLATE_VARIABLES

# stop strings a request may name: each is matched against the new text at every token, on the
# server's event loop (180k of them held /health for 19 s); lm-eval's `until` lists a few. OpenAI takes 4
MAX_STOPS, MAX_STOP_IDS = 64, 1024
REASONING_EFFORT = Literal["none", "minimal", "low", "medium", "high"]     # OpenAI's values (Responses' too)
BOUND = "x-ouro-bound"   # kinds: token_id, prompt_tokens, max_tokens, model (filled in by openapi.py)


class ServeError(Exception):
    """A request that ends in an HTTP error: its status and the message the client gets."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def check_model(state, model: str | None) -> None:
    """A request naming another model: 404 (`NotFoundError`), as vLLM and OpenAI answer."""
    if model is not None and model != state.model_name:
        raise ServeError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}")


def error_body(message: str, status: int, type_: str | None = None) -> dict:
    kinds = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
             413: "BadRequestError", 429: "RateLimitError", 500: "InternalServerError",
             503: "ServiceUnavailableError"}
    return {"object": "error", "message": message, "type": type_ or kinds.get(status, "Error"), "param": None,
            "code": status}


class Body(BaseModel):
    """A JSON body as the schema types it: no coercion (`0` is not `false`, `"5"` is not `5`)."""
    model_config = ConfigDict(strict=True)


def _integral(v):
    return int(v) if isinstance(v, float) and v.is_integer() else v


def integer(**bounds):
    """A JSON Schema integer (2.0 is one; "2" and true are not) within `bounds` (bounds first, so that
    `integer(...) | None` publishes them as minimum/maximum)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


Count, TopK = integer(ge=1), integer(ge=0, le=MAX_LOGPROBS)


def bound(kind: str) -> dict:
    """json_schema_extra of a field whose limit is this server's own (see BOUND)."""
    return {BOUND: kind}


def only(type_, schema: dict, ok, why: str):
    """An OpenAI field ouro does not implement: the schema names the one value it takes (`schema`),
    and any other is a 400 saying why, never silently ignored."""
    def check(v):
        if not ok(v):
            raise ValueError(why)
        return v
    return Annotated[type_, Field(json_schema_extra=schema), AfterValidator(check)]


def one_error(why: str) -> WrapValidator:
    """One plain 400 for a union that failed, instead of every member's complaint."""
    def wrap(v, handler):
        try:
            return handler(v)
        except ValidationError:
            raise ValueError(why) from None
    return WrapValidator(wrap)


def unicode_text(data):
    """JSON's \\u escapes can spell a lone surrogate, which is no Unicode text (RFC 8259 8.2): refused
    here with a 400 for the whole body, rather than by the tokenizer with an exception."""
    stack = [data]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"{v[:40]!a} is not Unicode text (a lone surrogate)") from None
        elif isinstance(v, dict):
            stack += [*v, *v.values()]
        elif isinstance(v, list):
            stack += v
    return data


def rule(if_: dict, then: dict) -> dict:
    """A cross-field rule as JSON Schema: when the body matches `if_` (properties given), `then` holds."""
    return {"if": {"properties": if_, "required": list(if_)}, "then": then}


TokenId = integer(ge=0, json_schema_extra=bound("token_id"))
TokenIds = Annotated[list[TokenId], Field(min_length=1, json_schema_extra=bound("prompt_tokens"))]
Text = Annotated[str, Field(min_length=1)]
NoPenalty = only(float, {"const": 0}, lambda v: v == 0, "presence_penalty and frequency_penalty are not supported "
                                                           "(use 0)")
NoLogitBias = only(dict[str, float] | None, {"maxProperties": 0}, lambda v: not v, "logit_bias is not supported")
NoBestOf = only(integer() | None, {"minimum": 1, "maximum": 1}, lambda v: v in (None, 1),
                "best_of is not supported (use 1, or n for several choices)")
NoMinTokens = only(integer() | None, {"minimum": 0, "maximum": 0}, lambda v: not v, "min_tokens is not supported (use 0)")
NoRepetitionPenalty = only(float | None, {"minimum": 1, "maximum": 1}, lambda v: v is None or v == 1,
                           "repetition_penalty is not supported (use 1)")
NoTruncation = only(integer() | None, {"type": "null"}, lambda v: v is None,
                    "truncate_prompt_tokens is not supported (send the tokens to keep)")
NoSuffix = only(str | None, {"maxLength": 0}, lambda v: not v, "suffix is not supported")
PROMPT_LOGPROBS = ("vLLM's prompt logprobs: each prompt token's logprob (the first's null) with its rank and the "
                   "top k; not with stream")
NOT_STREAMED = rule({"stream": {"const": True}}, {"properties": {"prompt_logprobs": {"type": "null"}}})
MAX_TOKENS = ("at most the context length less the prompt's tokens (the schema's maximum is for a one-token "
              "prompt); unset: up to the context length")


class JsonSchemaFormat(Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    """OpenAI's response_format: free text, any JSON object, or JSON that validates against a schema."""
    model_config = ConfigDict(json_schema_extra=rule({"type": {"const": "json_schema"}}, {
        "properties": {"json_schema": {"type": "object"}}, "required": ["json_schema"]}))
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Body):
    """vLLM's `structured_outputs`: one of these constrains the output."""
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# the structured-output constraints (`structured_request._fields` reads them the same way): each is
# "present" when it asks for a constraint, and a request carries at most one
SET = {"not": {"type": "null"}}
CONSTRAINTS = {
    "response_format": {"type": "object", "properties": {"type": {"enum": ["json_object", "json_schema"]}},
                        "required": ["type"]},
    **{f"structured_outputs.{k}": SET for k in ("json", "regex", "choice", "grammar")},
    "structured_outputs.json_object": {"const": True},
    **{k: SET for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "json_schema", "regex",
                        "ebnf")}}
# chat: a tool_choice that forces a call forces its tag, so it is one of them too (strict tools or not)
FORCED_CALL = {"properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}},
               "required": ["tool_choice"]}


def _present(path: str, schema: dict) -> dict:
    """A body in which the field at `path` (dotted) matches `schema`."""
    for key in reversed(path.split(".")):
        schema = {"properties": {key: schema}, "required": [key]}
    return schema


def at_most_one_constraint(chat: bool) -> dict:
    """JSON Schema for "at most one structured-output constraint": none present, or exactly one (`oneOf`)."""
    present = [_present(path, schema) for path, schema in CONSTRAINTS.items()] + ([FORCED_CALL] if chat else [])
    return {"anyOf": [{"not": {"anyOf": present}}, {"oneOf": present}]}


class StreamOptions(Body):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(Body):
    model_config = ConfigDict(extra="forbid")       # an undeclared field is a 400 naming it
    _unicode = model_validator(mode="before")(unicode_text)

    @model_validator(mode="after")
    def _prompt_logprobs_whole(self):                # NOT_STREAMED, as vLLM
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not available with stream: true")
        if self.stream_options is not None and not self.stream:       # as OpenAI and vLLM refuse it
            raise ValueError("stream_options is only for stream: true")
        return self
    model: str | None = Field(None, json_schema_extra=bound("model"))
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Count | None = Field(None, description=MAX_TOKENS, json_schema_extra=bound("max_tokens"))
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: integer(ge=-1) = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: integer(ge=-(1 << 63), lt=1 << 64) | None = None
    n: integer(ge=1, le=128) = 1
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = Field(
        None, description=f"at most {MAX_STOPS} strings (each is checked against the text at every token)")
    stop_token_ids: Annotated[list[integer(ge=0)], Field(max_length=MAX_STOP_IDS)] | None = None
    ignore_eos: bool = False
    return_tokens_as_token_ids: bool = Field(False, description="logprobs name each token 'token_id:N' (vLLM's "
                                             "extension: exact where a token's text is not unique)")
    presence_penalty: NoPenalty = 0.0
    frequency_penalty: NoPenalty = 0.0
    user: str | None = None
    logit_bias: NoLogitBias = None
    best_of: NoBestOf = None
    min_tokens: NoMinTokens = None
    repetition_penalty: NoRepetitionPenalty = None
    truncate_prompt_tokens: NoTruncation = None
    prompt_logprobs: TopK | None = Field(None, description=PROMPT_LOGPROBS)
    # structured outputs (`serve/structured_request.py`): at most one of these
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None       # vLLM's older names
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    regex: str | None = None                               # SGLang's
    ebnf: str | None = None
    json_schema: str | None = None


class CompletionRequest(_Sampling):
    prompt: Annotated[Union[Text, Annotated[list[Text], Field(min_length=1)], TokenIds,
                            Annotated[list[TokenIds], Field(min_length=1)]], one_error(
        "the prompt must be a non-empty string or a non-empty list of non-empty strings, of token ids (>= 0) or of "
        "non-empty lists of token ids")]
    model_config = ConfigDict(json_schema_extra={"allOf": [NOT_STREAMED, at_most_one_constraint(chat=False)]})
    max_tokens: integer(ge=0) | None = Field(None, description=MAX_TOKENS + "; 0: no token (with echo: the prompt "
                                             "and its logprobs only)", json_schema_extra=bound("max_tokens"))
    logprobs: TopK | None = None
    echo: bool = Field(False, description="the prompt before the completion in `text` and, with logprobs, its "
                                          "tokens first in `logprobs` (the first token's logprob null)")
    suffix: NoSuffix = None


class FunctionDef(Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None      # true: a forced call's arguments held to `parameters` (structured outputs)


class Tool(Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"] = "function"
    function: NamedFunction = Field(description="names one of the request's tools")


# a past tool call's arguments: an object, or its JSON text (blank: no arguments)
# (contentMediaType/contentSchema say "JSON text of an object"; the pattern and the example keep a generator
# that reads only patterns, or draws boundary values from them, on JSON text)
JSON_OBJECT_TEXT = {"type": "string", "pattern": r"^[ \t\n\r]*\{[\s\S]*\}[ \t\n\r]*$",
                    "contentMediaType": "application/json", "contentSchema": {"type": "object"},
                    "examples": ['{"path": "a.txt"}']}
BLANK = {"type": "string", "pattern": r"^\s*$"}
ARGUMENTS_TEXT = {"anyOf": [JSON_OBJECT_TEXT, BLANK]}
ARGUMENTS = {"anyOf": [{"type": "object"}, JSON_OBJECT_TEXT, BLANK, {"type": "null"}]}


class CalledFunction(Body):
    model_config = ConfigDict(extra="allow")
    name: Text
    arguments: Annotated[Any, WithJsonSchema(ARGUMENTS)] = None


class ToolCall(Body):
    model_config = ConfigDict(extra="allow")
    function: CalledFunction


class ContentPart(Body):
    model_config = ConfigDict(extra="allow", json_schema_extra=rule(   # a text part has its text
        {"type": {"const": "text"}}, {"properties": {"text": {"type": "string"}}, "required": ["text"]}))
    type: Annotated[Any, WithJsonSchema({"not": {"type": "null"}})]
    text: Any = None


class ChatMessage(Body):
    model_config = ConfigDict(extra="allow", json_schema_extra={   # only assistant messages carry tool calls
        "if": {"properties": {"role": {"const": "assistant"}}},
        "else": {"properties": {"tool_calls": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}}}})
    role: Literal["system", "developer", "user", "assistant", "tool"]   # chat_template.ROLES
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


RULES = [rule({"top_logprobs": {"type": "integer", "minimum": 1}},
              {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}),
         rule({"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}},
              {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]}),
         NOT_STREAMED, at_most_one_constraint(chat=True)]


class ChatCompletionRequest(_Sampling):
    model_config = ConfigDict(json_schema_extra={"allOf": RULES})
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = Field(None, description=MAX_TOKENS,
                                              json_schema_extra=bound("max_tokens"))
    logprobs: bool = False
    top_logprobs: TopK | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = Field(
        None, description="'required' or a named function needs tools; a forced tool call needs max_tokens "
                          "above the tokens of its opening tag and name")
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, json_schema_extra={"propertyNames": {"not": {"enum": list(TEMPLATE_VARIABLES)}}})
    reasoning_effort: REASONING_EFFORT | None = None
    add_generation_prompt: bool = True
