"""The agent's LLM client: any OpenAI-compatible chat endpoint with tool calling, through the
official `openai` package.

- `--endpoint` is the base URL (…/v1), `--model` the served name, and the key comes from an
  environment variable named by `api_key_env` (default OURO_AGENT_API_KEY; "none" if unset, for
  a local server).
- Transient failures (connection errors, 429, 5xx) are retried with exponential backoff;
  anything else fails at once with the endpoint's message.
- Every reply's usage is added to `tokens` (prompt and completion).
- A reply that is not a usable tool call (plain text, an unknown tool, arguments that are not a
  JSON object) is counted in `invalid` and answered with a correction the loop sends back; it
  never raises.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict


@dataclass
class Reply:
    text: str                          # the assistant's words, if any
    calls: list[ToolCall]              # usable tool calls
    correction: str | None = None      # what to tell the model when the reply was not usable
    message: dict = field(default_factory=dict)   # the assistant message, as it goes back into the history


class LLMClient:
    def __init__(self, endpoint: str, model: str, api_key_env: str = "OURO_AGENT_API_KEY", max_retries: int = 6,
                 backoff_s: float = 0.5, timeout_s: float = 120.0, max_tokens: int | None = None):
        try:
            from openai import OpenAI
        except ImportError:
            raise ValueError("the agent's LLM client needs the openai package: pip install -e '.[agent]'") from None
        self.model, self.max_retries, self.backoff_s, self.max_tokens = model, max_retries, backoff_s, max_tokens
        self.client = OpenAI(base_url=endpoint, api_key=os.environ.get(api_key_env) or "none", max_retries=0,
                             timeout=timeout_s)
        self.tokens = {"prompt": 0, "completion": 0}
        self.invalid = 0
        self.retries = 0

    def chat(self, messages: list[dict], tools: list[dict]) -> Reply:
        """One completion; the reply's usable tool calls, or a correction for the model."""
        response = self._create(messages, tools)
        usage = getattr(response, "usage", None)
        if usage is not None:
            self.tokens["prompt"] += usage.prompt_tokens or 0
            self.tokens["completion"] += usage.completion_tokens or 0
        msg = response.choices[0].message
        names = {t["function"]["name"] for t in tools}
        calls, problems = [], []
        for c in msg.tool_calls or []:
            try:
                args = json.loads(c.function.arguments or "{}")
            except json.JSONDecodeError as e:
                problems.append(f"the arguments of {c.function.name} are not JSON ({e})")
                continue
            if c.function.name not in names:
                problems.append(f"there is no tool {c.function.name!r}; the tools are {', '.join(sorted(names))}")
            elif not isinstance(args, dict):
                problems.append(f"the arguments of {c.function.name} must be a JSON object")
            else:
                calls.append(ToolCall(c.id, c.function.name, args))
        message = {"role": "assistant", "content": msg.content or ""}
        if msg.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                     for c in msg.tool_calls]
        correction = None
        if not calls:
            self.invalid += 1
            why = "; ".join(problems) or "the reply called no tool"
            correction = f"That reply was not a usable tool call: {why}. Answer with one call to one of the tools."
        # a reasoning model's thinking comes apart from its content (GLM, DeepSeek): either says what it meant
        said = msg.content or getattr(msg, "reasoning_content", None) or ""
        return Reply(said, calls, correction, message)

    def _create(self, messages, tools):
        import openai
        for attempt in range(self.max_retries + 1):
            try:
                extra = {"max_tokens": self.max_tokens} if self.max_tokens else {}
                return self.client.chat.completions.create(model=self.model, messages=messages, tools=tools, **extra)
            except (openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError) as e:
                if attempt == self.max_retries:
                    raise RuntimeError(f"the LLM endpoint failed {attempt + 1} times: {e}") from None
                self.retries += 1
                time.sleep(self.backoff_s * 2 ** attempt)
