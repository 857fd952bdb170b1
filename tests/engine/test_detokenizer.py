import pytest

from ouro.engine.detokenizer import IncrementalDetokenizer
from ouro.models.tokenizer_factory import build_tokenizer

PROMPT = "[gMASK]<sop><|user|>\nhi<|assistant|>\n"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(2000)


def _run(tok, text, stop=(), skip_special_tokens=True, ids=None):
    ids = tok.encode(text).ids if ids is None else ids
    det = IncrementalDetokenizer(tok, tok.encode(PROMPT).ids, list(stop), skip_special_tokens)
    pieces = []
    for t in ids:
        pieces.append(det.add(t))
        assert "".join(pieces) == det.text  # `text` is exactly what was released
    return det, ids, pieces


def test_no_stop_matches_full_decode(tok):
    text = "def add(a, b):\n    return a + b\n\nThe quick brown fox, naïve café."
    det, ids, pieces = _run(tok, text)
    tail = det.flush()
    assert det.text == tok.decode(ids) == text
    assert "".join(pieces) + tail == text
    assert not det.stopped and det.stop_reason is None
    assert sum(1 for p in pieces if p) > 5  # streamed incrementally, not all at the end


def _spanning_stop(tok, ids):
    """A 4-char stop made from the end of one token and the start of the next."""
    for i in range(1, len(ids) - 1):
        a, b = tok.decode([ids[i]]), tok.decode([ids[i + 1]])
        if len(a) >= 2 and len(b) >= 2:
            return a[-2:] + b[:2]
    raise AssertionError("no pair of multi-char tokens")


def test_stop_spanning_two_tokens_is_excluded(tok):
    text = "The answer is forty two and that settles the matter for good."
    ids = tok.encode(text).ids
    stop = _spanning_stop(tok, ids)
    assert all(stop not in tok.decode([t]) for t in ids)  # really spans a boundary
    det, _, pieces = _run(tok, text, stop=["zzz-never", stop])
    cut = text.index(stop)
    assert det.stopped and det.stop_reason == stop
    assert det.text == text[:cut]
    assert det.flush() == "" and det.add(ids[0]) == ""  # frozen after stopping
    assert det.text == text[:cut]


def test_earliest_stop_wins(tok):
    text = "alpha beta gamma delta"
    det, _, _ = _run(tok, text, stop=["delta", "beta"])
    assert det.stopped and det.stop_reason == "beta" and det.text == "alpha "


def test_stop_prefix_held_back_then_released(tok):
    text = "Hello world. Hello there, friend."
    stop = "Hello there!"
    ids = tok.encode(text).ids
    held_max = 0
    det = IncrementalDetokenizer(tok, [], [stop])
    for n in range(1, len(ids) + 1):
        det.add(ids[n - 1])
        so_far = tok.decode(ids[:n])
        assert so_far.startswith(det.text)
        held = so_far[len(det.text):]
        assert stop.startswith(held)  # only a possible stop start is withheld
        held_max = max(held_max, len(held))
    assert held_max >= len("Hello ")  # "Hello " and more was withheld at some point
    assert not det.stopped
    det.flush()
    assert det.text == text


def test_held_prefix_at_end_released_by_flush(tok):
    det, ids, pieces = _run(tok, "see you at the END", stop=["END OF TEXT"])
    assert det.text == "see you at the "  # "END" could still become the stop
    assert det.flush() == "END" and det.text == "see you at the END"


def test_multibyte_never_emitted_half(tok):
    text = "emoji 😀👍🏽 and 中文字符, ünïcödé 🇯🇵!"
    ids = tok.encode(text).ids
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # some tokens hold partial characters
    det, _, pieces = _run(tok, text)
    assert all("\ufffd" not in p for p in pieces)
    det.flush()
    assert det.text == tok.decode(ids) == text


def test_multibyte_stop_string(tok):
    text = "weather: ☀️ then 🌧 later"
    det, _, pieces = _run(tok, text, stop=["🌧"])
    assert det.stopped and det.text == "weather: ☀️ then "
    assert all("\ufffd" not in p for p in pieces)


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("done").ids + [tok.token_to_id("<|user|>")]
    det, _, _ = _run(tok, "", ids=ids)
    det.flush()
    assert det.text == "done"
    det, _, _ = _run(tok, "", ids=ids, skip_special_tokens=False, stop=["<|user|>"])
    assert det.stopped and det.stop_reason == "<|user|>" and det.text == "done"


@pytest.mark.parametrize("rule", ["plain", "stop_token", "stop_string_then_more", "held_then_finished"])
def test_update_makes_a_choice_text_by_its_rules(tok, rule):
    """`update` (what the engine offline and the server both use): the text of ids fed in chunks
    equals the rule's text: a stop token's text left out, ids after a stop string dropped, a held
    stop prefix released at the finish."""
    text = "def add(a, b):\n    return a + b\n"
    ids = tok.encode(text).ids
    stop = {"stop_string_then_more": [text[9:12]], "held_then_finished": [text[-3:-2] + "zz"]}.get(rule, [])
    det = IncrementalDetokenizer(tok, tok.encode(PROMPT).ids, stop)
    got, used_all = "", 0
    chunks = [ids[i:i + 3] for i in range(0, len(ids), 3)]
    for n, chunk in enumerate(chunks):
        last = n == len(chunks) - 1
        piece, used = det.update(chunk, stop_token=last and rule == "stop_token", finished=last)
        got += piece
        used_all += used
        if det.stopped:
            break
    if rule == "stop_string_then_more":
        assert det.stopped and got == text[:9] and used_all < len(ids)
        assert tok.decode(ids[:used_all]).find(stop[0]) >= 0               # the id that completed the stop is the last kept
        assert tok.decode(ids[:used_all - 1]).find(stop[0]) < 0
    elif rule == "stop_token":
        assert got == tok.decode(ids[:-1]) and used_all == len(ids)
    else:
        assert got == text == det.text and used_all == len(ids) and not det.stopped
