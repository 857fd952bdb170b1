"""Tests for the offline GLM-style tokenizer factory."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ouro.models.tokenizer_factory import (
    CHAT_TEMPLATE,
    MIN_VOCAB_SIZE,
    SPECIAL_TOKENS,
    build_tokenizer,
    write_tokenizer_files,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

TRICKY_TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\r\nwindows newlines\n\n\nand blank lines",
    "naïve café Zürich — ≤ ≥ ∞",
    "emoji 🙂 family 👨‍👩‍👧‍👦 flag 🇯🇵 skin 👍🏽",
    "中文，日本語のテキスト、한국어",
    "combining e\u0301 and zero\u200bwidth and nul \x00 bell \x07",
    "def f(x):\n    return {'a': [1, 2.5e-3, -7]}  # comment\n",
    "rare bytes \U0010fffd \ufeff end",
]

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
]
EXPECTED_CHAT = (
    "[gMASK]<sop><|system|>\nYou are terse.<|user|>\nHi there"
    "<|assistant|>\n<think></think>\nHello!<|user|>\nWhat is 2+2?<|assistant|>\n<think>"
)
GENERATION_PROMPT = "<|assistant|>\n<think>"


@pytest.fixture(scope="module")
def small_tok():
    return build_tokenizer(300)


@pytest.fixture(scope="module")
def big_tok():
    return build_tokenizer(32000)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    ids = write_tokenizer_files(directory, vocab_size=32000, model_max_length=4096)
    return directory, ids


@pytest.mark.processes
def test_build_is_deterministic_in_process_and_across_processes(big_tok):
    assert build_tokenizer(32000).to_str() == big_tok.to_str()
    # A fresh process gets a different Rust hash seed; the JSON must not change.
    code = (
        "import sys; from ouro.models.tokenizer_factory import build_tokenizer;"
        "sys.stdout.write(build_tokenizer(32000).to_str())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out == big_tok.to_str()


def test_vocab_size_bounds(small_tok, big_tok):
    # Small model: the corpus supports more merges, so the vocab is filled exactly.
    assert small_tok.get_vocab_size(with_added_tokens=True) == 300
    # Large model: capped by the corpus, well below the model vocab (intended).
    big = big_tok.get_vocab_size(with_added_tokens=True)
    assert 2000 <= big < 32000
    assert build_tokenizer(MIN_VOCAB_SIZE).get_vocab_size() == MIN_VOCAB_SIZE
    with pytest.raises(ValueError):
        build_tokenizer(MIN_VOCAB_SIZE - 1)


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_round_trip(small_tok, big_tok, text):
    for tok in (small_tok, big_tok):
        ids = tok.encode(text).ids
        assert all(0 <= i < tok.get_vocab_size() for i in ids)
        assert tok.decode(ids) == text


def test_bigger_vocab_compresses_better(small_tok, big_tok):
    text = "The scheduler decides which requests run next on the accelerator."
    assert len(big_tok.encode(text).ids) < len(small_tok.encode(text).ids)


def test_special_tokens_are_single_fixed_ids(small_tok, big_tok):
    for tok in (small_tok, big_tok):
        for expected_id, token in enumerate(SPECIAL_TOKENS):
            assert tok.encode(token).ids == [expected_id]
        # Inside text they still map to one id and survive decoding.
        text = "a<|user|>\nb<think>c</think>"
        ids = tok.encode(text).ids
        assert SPECIAL_TOKENS.index("<|user|>") in ids
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == "a\nbc"
        # GLM tool-call tags: one id each, kept by skip_special_tokens=False (what the chat parser reads)
        reply = "x</think>\n<tool_call>f\n<arg_key>k</arg_key>\n<arg_value>v 🙂</arg_value>\n</tool_call>"
        ids = tok.encode(reply).ids
        for tag in ("</think>", "<tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
                    "</tool_call>"):
            assert ids.count(tok.token_to_id(tag)) == 1
        assert tok.decode(ids, skip_special_tokens=False) == reply
        # one id at a time (how a streaming detokenizer sees them) joins to the same text
        assert "".join(tok.decode([i], skip_special_tokens=False) for i in ids[:3]) == "x</think>\n"
    assert SPECIAL_TOKENS[:12] == ("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>",
                                   "<|user|>", "<|assistant|>", "<|observation|>", "<think>", "</think>")


def test_written_files_and_returned_ids(hf_dir, big_tok):
    directory, ids = hf_dir
    assert ids["eos_token_id"] == ids["pad_token_id"] == big_tok.token_to_id("<|endoftext|>")
    assert ids["user_token_id"] == big_tok.token_to_id("<|user|>")
    assert ids["observation_token_id"] == big_tok.token_to_id("<|observation|>")
    assert ids["stop_token_ids"] == [ids["eos_token_id"], ids["user_token_id"], ids["observation_token_id"]]
    assert ids["tokenizer_size"] == big_tok.get_vocab_size()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == CHAT_TEMPLATE
    assert config["eos_token"] == config["pad_token"] == "<|endoftext|>"
    assert config["model_max_length"] == 4096
    special_map = json.loads((directory / "special_tokens_map.json").read_text())
    assert special_map["eos_token"] == "<|endoftext|>"
    assert json.loads((directory / "tokenizer.json").read_text()) == json.loads(big_tok.to_str())


def test_auto_tokenizer_loads_and_matches_raw(hf_dir, big_tok):
    transformers = pytest.importorskip("transformers")
    directory, ids = hf_dir
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    assert hf.eos_token_id == hf.pad_token_id == ids["eos_token_id"]
    assert hf.model_max_length == 4096
    assert len(hf) == big_tok.get_vocab_size()

    rendered = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == EXPECTED_CHAT
    no_prompt = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert no_prompt == EXPECTED_CHAT[: -len(GENERATION_PROMPT)]

    raw_ids = big_tok.encode(EXPECTED_CHAT).ids
    assert raw_ids[:2] == [big_tok.token_to_id("[gMASK]"), big_tok.token_to_id("<sop>")]
    assert hf(EXPECTED_CHAT)["input_ids"] == raw_ids  # no BOS/EOS added on top
    templated = hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    templated = templated["input_ids"] if hasattr(templated, "keys") else templated
    assert list(templated) == raw_ids
    for text in TRICKY_TEXTS:
        assert hf(text)["input_ids"] == big_tok.encode(text).ids
        assert hf.decode(big_tok.encode(text).ids) == text


def test_chat_template_tool_role_and_bad_role(hf_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(hf_dir[0])
    msgs = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": [{"type": "text", "text": "sunny"}, {"type": "image"}]},
    ]
    out = hf.apply_chat_template(msgs, tokenize=False)
    assert out == ("[gMASK]<sop><|user|>\nweather?<|assistant|>\n<think></think>"
                   "<|observation|>\n<tool_response>\nsunny<|begin_of_image|><|image|><|end_of_image|>\n</tool_response>")
    with pytest.raises(Exception, match="Unsupported chat role"):
        hf.apply_chat_template([{"role": "wizard", "content": "x"}], tokenize=False)
