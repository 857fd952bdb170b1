"""Offline, deterministic GLM-style tokenizer for tiny test/toy checkpoints.

The real GLM-5.3-Flash tokenizer cannot be downloaded in tests, so we train a
small byte-level BPE on a built-in corpus instead. Byte-level BPE with all 256
byte symbols in the alphabet can encode any text, so round-tripping never
depends on what the corpus happened to contain.

Vocab layout (fixed, independent of ``vocab_size``):
    ids 0..11      the GLM special tokens, in ``SPECIAL_TOKENS`` order
    ids 12..267    the 256 byte symbols
    ids 268..      learned merges

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

# GLM special tokens; order defines their ids (0..11), so never reorder.
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
)
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|endoftext|>"
# Tokens a GLM chat model stops on: end of text, or the start of the next turn.
STOP_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|user|>", "<|observation|>")

NUM_BYTES = 256
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + NUM_BYTES  # 268: no merges at all
# Upper bound on trained entries; a bigger vocab would only memorise the corpus.
MAX_TRAINED_VOCAB = 4096

# GLM-style chat template. Content may be a string, None, or a list of
# {"type": "text", "text": ...} parts (non-text parts are skipped). "tool" is
# accepted as an alias of GLM's "observation" role (OpenAI-style tool results).
CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is defined and content is not none -%}"
    "{%- for part in content -%}"
    "{%- if part is string -%}{{ part }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "[gMASK]<sop>"
    "{%- for message in messages -%}"
    "{%- set role = 'observation' if message['role'] == 'tool' else message['role'] -%}"
    "{%- if role not in ['system', 'user', 'assistant', 'observation'] -%}"
    "{{ raise_exception('Unsupported chat role: ' + message['role']) }}"
    "{%- endif -%}"
    "{{ '<|' + role + '|>' }}\n{{ render_content(message['content']) }}"
    "{%- endfor -%}"
    # No "-" right after a literal newline: it would strip the newline.
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}\n{% endif %}"
)


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Train the byte-level BPE; same result on every machine and run."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be >= {MIN_VOCAB_SIZE} "
            f"({len(SPECIAL_TOKENS)} special tokens + {NUM_BYTES} bytes), got {vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    # No prefix space: keeps encode/decode an exact inverse for any text.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, MAX_TRAINED_VOCAB),
        # 1 lets the small corpus yield as many merges as possible; ties are
        # broken by symbol ids inside the trainer, so the result is stable.
        min_frequency=1,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # One document: keeps "\n\n" and newline+indent pairs that code relies on.
    tokenizer.train_from_iterator([CORPUS], trainer=trainer, length=1)
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
    directory: str | os.PathLike[str], vocab_size: int, model_max_length: int
) -> dict:
    """Write tokenizer.json / tokenizer_config.json / special_tokens_map.json.

    Returns the ids from ``special_token_ids`` plus ``tokenizer_size`` (the
    real number of entries, which may be below ``vocab_size``).
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    # to_str() is byte-identical across runs, so checkpoints diff cleanly.
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")

    extra = [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)]
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
