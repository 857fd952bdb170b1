"""Offline, deterministic GLM-style tokenizer for tiny test/toy checkpoints.

The real GLM-5.3-Flash tokenizer cannot be downloaded in tests, so we train a
small byte-level BPE on a built-in corpus instead. Byte-level BPE with all 256
byte symbols in the alphabet can encode any text, so round-tripping never
depends on what the corpus happened to contain.

Vocab layout (fixed, independent of ``vocab_size``):
    ids 0..19      the GLM special tokens, in ``SPECIAL_TOKENS`` order (0..11 are the
                   original twelve; 12..19 the tool-call tags, added after them)
    ids 20..275    the 256 byte symbols
    ids 276..      learned merges

``extra_special`` tokens (the image/video tokens of a vision preset) take the top ids of the
tokenizer, after the merges: training stops that many entries short, so a tokenizer built
without them is unchanged.

The tokenizer has at most ``min(vocab_size, MAX_TRAINED_VOCAB)`` entries and
in practice is capped further by how many merges the small corpus supports
(~2.6k). For a large model vocab (e.g. 32000) the tokenizer is therefore
SMALLER than the embedding table: that is intended. Ids above the tokenizer's
size are simply never produced by encoding; decoding them yields nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ouro.models.tokenizer_corpus import CORPUS

# GLM special tokens; order defines their ids (0..19), so never reorder. New ones go at the end.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<tool_response>",
    "</tool_response>",
)
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|endoftext|>"
# Tokens a GLM chat model stops on: end of text, or the start of the next turn.
STOP_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|user|>", "<|observation|>")

# Image and video tokens (GLM's spelling), added only where asked (`extra_special`); in the order
# of config.model.MEDIA_TOKEN_FIELDS, the config.json fields naming their ids
MEDIA_TOKENS: tuple[str, ...] = (
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
)

NUM_BYTES = 256
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + NUM_BYTES  # 276: no merges at all
# Upper bound on trained entries; a bigger vocab would only memorise the corpus.
MAX_TRAINED_VOCAB = 4096

# GLM-5.3-style chat template (written for ouro; GLM's layout, not a copy of its file).
# - tools (OpenAI JSON schemas) go into a first <|system|> turn, with the tool-call syntax;
# - content may be a string, None/missing, or a list of text parts (other parts are skipped);
# - assistant turns: <think>REASONING</think> (reasoning kept only after the last user turn,
#   as GLM does), then content, then tool calls in GLM syntax; string argument values are
#   written raw, others as JSON; `arguments` must be a mapping (ouro's renderer parses
#   OpenAI's JSON strings first);
# - "tool" messages become one <|observation|> turn per run of results, each in
#   <tool_response>...</tool_response>; "developer" is a system turn; other roles raise;
# - an image part is the model's placeholder, <|begin_of_image|><|image|><|end_of_image|> (the
#   processor expands <|image|> to the image's token count);
# - thinking is on unless reasoning_effort == "none" or enable_thinking is false: the
#   generation prompt is "<|assistant|>\n<think>" (on) or "<|assistant|>\n<think></think>" (off).
CHAT_TEMPLATE = r"""
{%- macro visible_text(content) -%}
  {%- if content is string -%}{{- content -}}
  {%- elif content is iterable and content is not mapping -%}
    {%- for part in content -%}
      {%- if part is string -%}{{- part -}}
      {%- elif part is mapping and part.type == 'text' -%}{{- part.text -}}
      {%- elif part is mapping and part.type in ('image', 'image_url', 'input_image') -%}
        {{- '<|begin_of_image|><|image|><|end_of_image|>' -}}
      {%- endif -%}
    {%- endfor -%}
  {%- elif content is defined and content is not none -%}{{- content -}}
  {%- endif -%}
{%- endmacro -%}
{%- set effort_off = reasoning_effort is defined and reasoning_effort is string and reasoning_effort | lower == 'none' -%}
{%- set flag_off = enable_thinking is defined and enable_thinking is not none and not enable_thinking -%}
{%- set thinking = not (effort_off or flag_off) -%}
{{- '[gMASK]<sop>' -}}
{%- if tools -%}
  {{- '<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
  {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n' -}}
  {%- for tool in tools -%}{{- tool | tojson -}}{{- '\n' -}}{%- endfor -%}
  {{- '</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n' -}}
  {{- '<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n' -}}
  {{- '<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
  {%- if m.role == 'system' or m.role == 'developer' -%}
    {{- '<|system|>\n' + visible_text(m.content) -}}
  {%- elif m.role == 'user' -%}
    {{- '<|user|>\n' + visible_text(m.content) -}}
  {%- elif m.role == 'assistant' -%}
    {%- set content = visible_text(m.content) -%}
    {%- set reasoning = '' -%}
    {%- if m.reasoning_content is string -%}
      {%- set reasoning = m.reasoning_content -%}
    {%- elif '</think>' in content -%}
      {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
      {%- set content = content.split('</think>')[-1] -%}
    {%- endif -%}
    {{- '<|assistant|>\n<think>' -}}
    {%- if loop.index0 > ns.last_user -%}{{- reasoning | trim -}}{%- endif -%}
    {{- '</think>' -}}
    {%- if content | trim -%}{{- '\n' + content | trim -}}{%- endif -%}
    {%- if m.tool_calls is defined and m.tool_calls -%}
      {%- for tc in m.tool_calls -%}
        {%- set f = tc.function if tc.function is defined else tc -%}
        {{- '\n<tool_call>' + f.name -}}
        {%- if f.arguments is mapping -%}
          {%- for key, value in f.arguments.items() -%}
            {{- '\n<arg_key>' + key + '</arg_key>\n<arg_value>' -}}
            {{- value if value is string else value | tojson -}}
            {{- '</arg_value>' -}}
          {%- endfor -%}
        {%- elif f.arguments is defined and f.arguments is not none and f.arguments | trim not in ['', '{}'] -%}
          {{- raise_exception('tool call arguments must be a mapping, not ' + f.arguments | string) -}}
        {%- endif -%}
        {{- '\n</tool_call>' -}}
      {%- endfor -%}
    {%- endif -%}
  {%- elif m.role == 'tool' or m.role == 'observation' -%}
    {%- if loop.first or messages[loop.index0 - 1].role not in ['tool', 'observation'] -%}
      {{- '<|observation|>' -}}
    {%- endif -%}
    {{- '\n<tool_response>\n' + visible_text(m.content) + '\n</tool_response>' -}}
  {%- else -%}
    {{- raise_exception('Unsupported chat role: ' + m.role | string) -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|assistant|>\n<think>' if thinking else '<|assistant|>\n<think></think>' -}}
{%- endif -%}
""".strip()


def build_tokenizer(vocab_size: int, texts=None, max_vocab: int = MAX_TRAINED_VOCAB,
                    extra_special: tuple[str, ...] = ()) -> Tokenizer:
    """Train the byte-level BPE; same result on every machine and run. `texts`: documents to
    train on (default: the small built-in corpus, kept as one document). `extra_special`: special
    tokens given the ids right after the trained entries (the top of the tokenizer)."""
    if vocab_size - len(extra_special) < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be >= {MIN_VOCAB_SIZE + len(extra_special)} "
            f"({len(SPECIAL_TOKENS)} special tokens + {NUM_BYTES} bytes"
            + (f" + {len(extra_special)} extra special tokens" if extra_special else "") + f"), got {vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    # No prefix space: keeps encode/decode an exact inverse for any text.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, max_vocab) - len(extra_special),
        # 1 lets the small corpus yield as many merges as possible; ties are
        # broken by symbol ids inside the trainer, so the result is stable.
        min_frequency=1,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # One document: keeps "\n\n" and newline+indent pairs that code relies on.
    docs = [CORPUS] if texts is None else list(texts)
    tokenizer.train_from_iterator(docs, trainer=trainer, length=len(docs))
    if extra_special:
        tokenizer.add_special_tokens(list(extra_special))
    _check_layout(tokenizer, vocab_size)
    return tokenizer


def _check_layout(tokenizer: Tokenizer, vocab_size: int) -> None:
    # Cheap guard so a tokenizers upgrade that changes the id layout fails
    # loudly instead of silently shifting special-token ids.
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != expected_id:
            raise RuntimeError(f"special token {token!r} did not get id {expected_id}")
    if tokenizer.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise RuntimeError("trained tokenizer exceeds the requested vocab_size")


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """Ids the caller needs for generation_config.json."""

    def tid(token: str) -> int:
        value = tokenizer.token_to_id(token)
        if value is None:
            raise KeyError(token)
        return value

    return {
        "eos_token_id": tid(EOS_TOKEN),
        "pad_token_id": tid(PAD_TOKEN),
        "user_token_id": tid("<|user|>"),
        "observation_token_id": tid("<|observation|>"),
        # GLM convention: generation_config.eos_token_id is this list.
        "stop_token_ids": [tid(t) for t in STOP_TOKENS],
    }


def write_tokenizer_files(
    directory: str | os.PathLike[str], vocab_size: int, model_max_length: int, tokenizer: Tokenizer | None = None,
    extra_special: tuple[str, ...] = (),
) -> dict:
    """Write tokenizer.json / tokenizer_config.json / special_tokens_map.json (of `tokenizer`,
    default: the one `build_tokenizer(vocab_size, extra_special=)` trains on the built-in corpus).

    Returns the ids from ``special_token_ids`` plus ``tokenizer_size`` (the
    real number of entries, which may be below ``vocab_size``).
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer or build_tokenizer(vocab_size, extra_special=extra_special)
    # to_str() is byte-identical across runs, so checkpoints diff cleanly.
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")

    extra = [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)] + list(extra_special)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        # GLM adds [gMASK]<sop> through the chat template, not automatically.
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": extra,
    }
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", special_map)

    ids = special_token_ids(tokenizer)
    ids["tokenizer_size"] = tokenizer.get_vocab_size(with_added_tokens=True)
    return ids


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
