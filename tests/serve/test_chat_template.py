"""Chat template rendering: the preset's GLM-5.3-style template through ouro's renderer, equal to
transformers' apply_chat_template; OpenAI message forms; thinking switches; errors."""

import json

import pytest
from tokenizers import Tokenizer

from ouro.models.tokenizer_factory import write_tokenizer_files
from ouro.serve.chat_template import ChatTemplate, normalize_messages
from ouro.serve.glm_parser import ReplyFormat, parse_reply, starts_in_reasoning

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Météo du jour ☀",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}, "days": {"type": "integer"},
                                          "units": {"type": "object"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "list_files", "parameters": {"type": "object", "properties": {}}}},
]
CALLS = [
    {"id": "call_0", "type": "function",
     "function": {"name": "get_weather", "arguments": {"city": "Paris\n  (FR)", "days": 3, "units": {"t": "C"}}}},
    {"id": "call_1", "type": "function", "function": {"name": "list_files", "arguments": {}}},
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}]},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "Need the tool.", "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 21C"},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "a.txt"}]},
    {"role": "assistant", "content": "Sunny."},
    {"role": "user", "content": "Thanks"},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat")
    write_tokenizer_files(d, vocab_size=512, model_max_length=4096)
    return d


@pytest.fixture(scope="module")
def template(checkpoint):
    return ChatTemplate.from_checkpoint(checkpoint)


@pytest.fixture(scope="module")
def hf(checkpoint):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(checkpoint)


def test_generation_prompt_thinking_on_and_off(template):
    msgs = [{"role": "user", "content": "hi"}]
    on = template.render(msgs)
    assert on == "[gMASK]<sop><|user|>\nhi<|assistant|>\n<think>" and starts_in_reasoning(on)
    assert template.render(msgs, reasoning_effort="high") == on
    assert template.render(msgs, enable_thinking=True) == on
    off = "[gMASK]<sop><|user|>\nhi<|assistant|>\n<think></think>"
    for kw in ({"reasoning_effort": "none"}, {"enable_thinking": False}, {"reasoning_effort": "None"},
               {"enable_thinking": True, "reasoning_effort": "none"}):
        assert template.render(msgs, **kw) == off, kw
        assert not starts_in_reasoning(off)
    assert template.render(msgs, add_generation_prompt=False) == "[gMASK]<sop><|user|>\nhi"


def test_thinking_switches_are_aliased_for_templates_that_read_one():
    effort_only = ChatTemplate("{{ reasoning_effort | default('unset') }}|{{ enable_thinking | default('unset') }}")
    msgs = [{"role": "user", "content": "x"}]
    assert effort_only.render(msgs, enable_thinking=False) == "none|False"
    assert effort_only.render(msgs, reasoning_effort="none") == "none|False"
    assert effort_only.render(msgs, reasoning_effort="low") == "low|unset"
    assert effort_only.render(msgs, reasoning_effort=None) == "unset|unset"


def test_tools_go_into_the_system_prompt(template):
    text = template.render([{"role": "user", "content": "hi"}], tools=TOOLS)
    head = "[gMASK]<sop><|system|>\n# Tools\n"
    assert text.startswith(head) and text.count("<|system|>") == 1
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n" + json.dumps(TOOLS[1]) + "\n</tools>" in text
    assert "Météo du jour ☀" in text
    assert "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>" in text
    assert text.endswith("</tool_call><|user|>\nhi<|assistant|>\n<think>")
    assert template.render([{"role": "user", "content": "hi"}], tools=[]) == template.render(
        [{"role": "user", "content": "hi"}])


def test_assistant_tool_calls_and_observations(template):
    text = template.render(CONVERSATION, tools=TOOLS)
    turn = ("<|assistant|>\n<think></think>\nChecking."
            "\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris\n  (FR)</arg_value>"
            "\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>"
            '\n<arg_key>units</arg_key>\n<arg_value>{"t": "C"}</arg_value>\n</tool_call>'
            "\n<tool_call>list_files\n</tool_call>")
    observation = ("<|observation|>\n<tool_response>\nsunny, 21C\n</tool_response>"
                   "\n<tool_response>\na.txt\n</tool_response>")
    assert turn + observation + "<|assistant|>\n<think></think>\nSunny.<|user|>\nThanks<|assistant|>\n<think>" in text
    assert "<|user|>\nWeather in Paris?" in text and "Need the tool." not in text   # before the last user turn
    # in the current tool loop (after the last user turn) the reasoning is kept
    loop = template.render(CONVERSATION[:5], tools=TOOLS)
    assert "<|assistant|>\n<think>Need the tool.</think>\nChecking.\n<tool_call>get_weather" in loop
    assert loop.endswith("</tool_response><|assistant|>\n<think>")


def test_arguments_as_json_string_render_like_dicts(template):
    as_strings = [dict(m) for m in CONVERSATION]
    as_strings[2] = dict(as_strings[2], tool_calls=[
        {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}} for c in CALLS])
    as_strings[2]["tool_calls"][1]["function"]["arguments"] = ""
    assert template.render(as_strings, tools=TOOLS) == template.render(CONVERSATION, tools=TOOLS)


def test_rendered_tool_calls_parse_back(template):
    """The GLM syntax the template writes is what the parser reads: render -> parse round trip."""
    text = template.render(CONVERSATION[:3], tools=TOOLS, add_generation_prompt=False)
    reply = text[text.rindex("<|assistant|>\n<think>") + len("<|assistant|>\n<think>"):]
    parsed = parse_reply(reply, ReplyFormat.for_request("<think>", TOOLS, "auto", "call_"))
    assert parsed.reasoning_content == "Need the tool." and parsed.content == "Checking."
    assert [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [
        c["function"]["arguments"] for c in CALLS]
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather", "list_files"]


def test_message_forms(template):
    base = template.render([{"role": "user", "content": "hi"}])
    assert template.render([{"role": "developer", "content": "Be kind."}, {"role": "user", "content": "hi"}]) == \
        base.replace("[gMASK]<sop>", "[gMASK]<sop><|system|>\nBe kind.")
    with_image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                               {"type": "text", "text": "hi"}]}]
    # an image part is the model's placeholder (the processor expands <|image|> to the image's tokens)
    assert template.render(with_image) == base.replace("<|user|>\nhi", "<|user|>\n<|begin_of_image|><|image|><|end_of_image|>hi")
    assert template.render([{"role": "user", "content": None}, {"role": "assistant", "content": None},
                            {"role": "user", "content": "hi"}]) == \
        "[gMASK]<sop><|user|>\n<|assistant|>\n<think></think><|user|>\nhi<|assistant|>\n<think>"
    # history given as "<think>...</think>answer" without reasoning_content
    assert "<think></think>\nold answer" in template.render(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>old</think>\nold answer"},
         {"role": "user", "content": "q2"}])
    msgs = normalize_messages([{"role": "assistant", "content": None, "reasoning": "r", "tool_calls": None}])
    assert msgs == [{"role": "assistant", "reasoning": "r", "reasoning_content": "r", "thinking": "r"}]


@pytest.mark.parametrize("messages, match", [
    ([{"role": "wizard", "content": "x"}], r"messages\[0\] has unsupported role 'wizard'"),
    ([{"content": "x"}], r"messages\[0\] has unsupported role None"),
    (["hello"], r"messages\[0\] must be an object"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\.content must be"),
    ([{"role": "user", "content": [{"type": "text"}]}], r"content\[0\] is a text part"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}],
     r"tool_calls\[0\]\.function\.arguments is not valid JSON"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
     r"must be a JSON object"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], r"name must be a non-empty"),
    ([{"role": "user", "tool_calls": [{"function": {"name": "f"}}]}], r"only assistant messages"),
])
def test_invalid_messages_raise_value_error(template, messages, match):
    with pytest.raises(ValueError, match=match):
        template.render(messages)


def test_template_errors_are_value_errors():
    t = ChatTemplate("{{ raise_exception('no system messages, please') }}")
    with pytest.raises(ValueError, match="chat template error: no system messages, please"):
        t.render([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="chat template error"):
        ChatTemplate("{{ messages[0].__class__ }}{{ ''.__class__.__mro__ }}").render([{"role": "user", "content": "x"}])


def test_template_sources(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "</s>"}, "chat_template": [
            {"name": "default", "template": "D{{ eos_token }}"}, {"name": "tool_use", "template": "T"}]}))
    t = ChatTemplate.from_checkpoint(tmp_path)
    msgs = [{"role": "user", "content": "x"}]
    assert t.render(msgs) == "D</s>" and t.render(msgs, tools=TOOLS) == "T"
    (tmp_path / "chat_template.jinja").write_text("{% generation %}J{{ messages | length }}{% endgeneration %}"
                                                  "{% for m in messages %}{% if loop.first %}{% break %}"
                                                  "{% endif %}{% endfor %}{{ {'a': 'é'} | tojson }}")
    assert ChatTemplate.from_checkpoint(tmp_path).render(msgs) == 'J1{"a": "é"}'
    assert ChatTemplate.from_checkpoint(tmp_path / "missing") is None
    # transformers' whitespace rules: trim_blocks and lstrip_blocks
    layout = ChatTemplate("{% for m in messages %}\n  {% if m.role %}\n[{{ m.role }}]\n  {% endif %}\n{% endfor %}")
    assert layout.render(msgs * 2) == "[user]\n[user]\n"


@pytest.mark.parametrize("kwargs", [{}, {"reasoning_effort": "none"}, {"enable_thinking": False}])
def test_equal_to_transformers_apply_chat_template(template, hf, checkpoint, kwargs):
    conversations = [CONVERSATION, CONVERSATION[:5], CONVERSATION[:1] + [{"role": "developer", "content": "d"}]
                     + CONVERSATION[1:2]]
    raw = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    for conv in conversations:
        for tools in (None, TOOLS):
            for gen in (True, False):
                ours = template.render(conv, tools=tools, add_generation_prompt=gen, **kwargs)
                theirs = hf.apply_chat_template(conv, tools=tools, tokenize=False, add_generation_prompt=gen,
                                                **kwargs)
                assert ours == theirs
        ids = hf.apply_chat_template(conv, tools=TOOLS, tokenize=True, add_generation_prompt=True, **kwargs)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert list(ids) == raw.encode(template.render(conv, tools=TOOLS, **kwargs), add_special_tokens=False).ids
